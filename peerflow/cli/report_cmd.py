"""`peerflow report RUN_DIR`: PNG plots of a run's metrics."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Adds the `report` subcommand."""
    parser = subparsers.add_parser(
        "report", help="render a run's metrics as PNG plots",
        description="Plot reward (with its components and spread), response length, KL, "
        "throughput, step-time breakdown and (async runs) staleness/overlap from "
        "RUN_DIR/metrics.jsonl; metrics that never changed are listed, not plotted.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory with metrics.jsonl")
    parser.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/report)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="moving-average window over steps (default 1: raw)")
    parser.set_defaults(func=run)


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
