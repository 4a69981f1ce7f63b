"""The `peerflow` command: one entry point, one module per subcommand.

A subcommand module defines `add_parser(subparsers)`, which adds its parser and sets
`func=run` (a callable taking the parsed args and returning an exit code). Heavy imports
happen inside `run`, so `peerflow --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from peerflow import __version__
from peerflow.errors import PeerFlowError

#: Subcommand modules under `peerflow.cli`, in `--help` order.
COMMANDS = [
    "train_cmd", "eval_cmd", "checkpoints_cmd", "plugins_cmd", "config_cmd", "plan_cmd",
    "bench_cmd", "report_cmd", "samples_cmd", "export_cmd", "sft_cmd", "conformance_cmd",
    "sandbox_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    """Returns the top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="peerflow",
        description="PeerFlow: controller-free RL post-training for language models.",
        epilog="Run `peerflow COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"peerflow {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"peerflow.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PeerFlowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
