"""`peerflow samples RUN_DIR`: what the model generated, in the terminal.

    peerflow samples runs/qs                    # the newest step's samples
    peerflow samples runs/qs --step 7 --worst   # step 7, lowest reward first
    peerflow samples runs/qs --best --limit 3
    peerflow samples runs/qs --eval             # the newest evaluation's samples
    peerflow samples runs/qs --json             # one JSON object a line

Reads `RUN_DIR/samples/step_N.jsonl` (`run.samples_per_step` a step) or, with `--eval`,
`eval_step_N.jsonl` (`peerflow.outputs.samples`). Model text is printed with its control
characters escaped (`peerflow.outputs.terminal`): a response cannot clear the screen or
write the clipboard of whoever reads it.
"""

from __future__ import annotations

import argparse

from peerflow.cli.options import add_json_flag, add_run_dir_argument

HELP = "show a run's generated samples (prompt, response, reward)"
DESCRIPTION = ("Print the samples a run wrote for a step (default: the newest): prompt, "
               "response, reward and its components, advantage, finish reason.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds RUN_DIR, `--step`, `--worst`/`--best`, `--limit`, `--eval` and `--json`."""
    add_run_dir_argument(parser, "run directory")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="the step to show (default: the newest with samples)")
    order = parser.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true", help="lowest reward first")
    order.add_argument("--best", action="store_true", help="highest reward first")
    parser.add_argument("--limit", type=int, default=None, metavar="K",
                        help="show at most K samples")
    parser.add_argument("--eval", dest="evaluation", action="store_true",
                        help="the evaluation's samples (eval_step_N.jsonl)")
    add_json_flag(parser, "print JSON lines instead")


def run(args: argparse.Namespace) -> int:
    """Prints the samples; a missing run, step or samples directory is an error."""
    from peerflow.errors import PeerFlowError
    from peerflow.outputs.samples import order_samples, read_samples, render_samples
    from peerflow.outputs.terminal import escape_json

    try:
        step, samples = read_samples(args.run_dir, args.step, evaluation=args.evaluation)
    except (FileNotFoundError, ValueError) as exc:
        raise PeerFlowError(str(exc)) from None
    shown = order_samples(samples, worst=args.worst, best=args.best, limit=args.limit)
    if args.json:
        for sample in shown:
            print(escape_json(sample))
        return 0
    order = ", lowest reward first" if args.worst else (
        ", highest reward first" if args.best else "")
    kind = " (evaluation)" if args.evaluation else ""
    render_samples(shown, step=step, header=f"{kind}{order}")
    return 0
