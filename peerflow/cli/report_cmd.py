"""`peerflow report RUN_DIR`: PNG plots of a run's metrics."""

from __future__ import annotations

import argparse

from peerflow.cli.options import add_run_dir_argument

HELP = "render a run's metrics as PNG plots"
DESCRIPTION = ("Plot reward (with its components and spread), response length, KL, "
               "throughput, step-time breakdown and (async runs) staleness/overlap from "
               "RUN_DIR/metrics.jsonl; metrics that never changed are listed, not plotted.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds RUN_DIR, `--out` and `--smooth`."""
    add_run_dir_argument(parser, "run directory with metrics.jsonl")
    parser.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/report)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="moving-average window over steps (default 1: raw)")


def run(args: argparse.Namespace) -> int:
    """Renders the report and prints the files written and the reward summary."""
    import json

    from peerflow.errors import PeerFlowError
    from peerflow.outputs.report import render_report

    try:
        files = render_report(args.run_dir, args.out, smooth=args.smooth)
    except (FileNotFoundError, ValueError) as exc:
        raise PeerFlowError(str(exc)) from None
    for path in files:
        print(path)
    summary = json.loads(files[-1].read_text())
    reward = summary["metrics"].get("reward/mean")
    if reward:
        print(f"reward/mean: first 5 steps {reward['first_mean']:.3f}, last 5 steps "
              f"{reward['last_mean']:.3f} ({summary['steps']} steps logged)")
    for name in ("off_policy/is_weight_mean", "off_policy/is_weight_max",
                 "off_policy/truncated_fraction", "off_policy/masked_fraction",
                 "mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl"):
        if name in summary["metrics"]:
            m = summary["metrics"][name]
            print(f"{name}: first 5 steps {m['first_mean']:.4g}, last 5 steps "
                  f"{m['last_mean']:.4g}")
    constants = summary.get("constant", {})
    if constants:
        print("constant (not plotted): " + ", ".join(f"{k}={v:.4g}"
                                                    for k, v in sorted(constants.items())))
    return 0
