"""The `peerflow` command: one entry point, one module per subcommand.

How a subcommand joins the command (`build_parser` does the joining, for every module
listed in `COMMANDS`): the module `peerflow.cli.NAME_cmd` is the command `NAME` (an
underscore becomes a hyphen) and defines

* `HELP`: the one line `peerflow --help` lists it with;
* `DESCRIPTION`: the paragraph at the top of `peerflow NAME --help`;
* `add_arguments(parser)`: adds its options to the parser `build_parser` made for it
  (options several commands share come from `peerflow.cli.options`);
* `run(args) -> int`: what it does (the exit code), for a command with one action. A
  command with several actions (`config`, `sandbox`, `bench`) defines no `run`: its
  `add_arguments` adds one sub-parser per action and sets each one's `func`.

Heavy imports happen inside `run`, so `peerflow --help` stays fast. Benchmarks join
`peerflow bench` the same way one level down (`peerflow.cli.bench_cmd`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from peerflow import __version__
from peerflow.errors import PeerFlowError

#: Subcommand modules under `peerflow.cli`, in `--help` order.
COMMANDS = [
    "train_cmd", "eval_cmd", "checkpoints_cmd", "plugins_cmd", "config_cmd", "plan_cmd",
    "bench_cmd", "report_cmd", "samples_cmd", "export_cmd", "sft_cmd", "conformance_cmd",
    "sandbox_cmd",
]


def command_name(module: str) -> str:
    """The command a module under `peerflow.cli` is: `checkpoints_cmd` → `checkpoints`."""
    return module.removesuffix("_cmd").replace("_", "-")


def add_command(subparsers: argparse._SubParsersAction, module: ModuleType) -> None:
    """Adds the command `module` defines (see the module docstring) to `subparsers`."""
    name = command_name(module.__name__.rpartition(".")[2])
    parser = subparsers.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
    module.add_arguments(parser)
    if hasattr(module, "run"):
        parser.set_defaults(func=module.run)


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
        add_command(subparsers, importlib.import_module(f"peerflow.cli.{name}"))
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
        from peerflow.outputs.terminal import escape_control

        # a reward's error can quote model-written text: shown, never obeyed
        print(f"error: {escape_control(exc)}", file=sys.stderr)
        return 1
