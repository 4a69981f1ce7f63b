"""`peerflow eval CONFIG [--checkpoint DIR]`: score the held-out split once.

    peerflow eval CONFIG --checkpoint runs/my-run              # its newest checkpoint
    peerflow eval CONFIG --checkpoint runs/my-run/checkpoints/step_000050
    peerflow eval CONFIG --set eval.n=8 --set eval.max_prompts=256
    peerflow eval CONFIG --checkpoint runs/old-run --trust-checkpoint  # a pickle you wrote

Runs the same workers as `peerflow train` (same launcher, same config validation), loads
the checkpoint into the trainable engines, syncs the rollout engine, and evaluates as
`run.eval_every` does (`peerflow.worker.evaluation`). The metrics are printed and
written to `OUT/eval.json` (default: a fresh `runs/eval-<config>-<UTC timestamp>`).
A checkpoint file that is a pickle the safe loader refuses is refused, naming the file,
unless `--trust-checkpoint` is given (`peerflow.checkpoint.pickles`).
"""

from __future__ import annotations

import argparse
import json

from peerflow.cli.options import (
    add_override_argument,
    add_trust_checkpoint_argument,
    add_worker_arguments,
    apply_trust,
)

HELP = "evaluate a checkpoint on the task's held-out split"
DESCRIPTION = ("Score the eval split (greedy and/or sampled, pass@k) with the run's rewards, "
               "once, on a checkpoint or the initial model.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds CONFIG, `--checkpoint`, `--out`, the worker options, `--trust-checkpoint`, `--set`."""
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a checkpoint directory, or a run directory (its newest "
                        "complete checkpoint); default: the initial model")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where eval.json goes (default: a fresh runs/eval-<config>-...)")
    add_worker_arguments(parser)
    add_trust_checkpoint_argument(parser)
    add_override_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Runs `peerflow eval`; prints the metrics and returns the exit code.

    The warm fork server starts only once the config passed validation (in `launch`), so
    a refused command returns in the time validation takes.
    """
    from peerflow.api import evaluate

    apply_trust(args)
    result = evaluate(args.config, checkpoint=args.checkpoint, overrides=args.overrides,
                      out_dir=args.out, nprocs=args.nprocs, launcher=args.launcher)
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0
