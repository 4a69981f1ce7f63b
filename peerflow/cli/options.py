"""Options several `peerflow` commands share: each defined once, read by the same name.

A command's `add_arguments` calls these for what it has in common with other commands;
where the help line says something about that command in particular, it passes its own.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the CONFIG argument and `--set` overrides (`args.config`, `args.overrides`)."""
    parser.add_argument("config", metavar="CONFIG", help="run config YAML file")
    add_override_argument(parser)


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--set KEY=VALUE` (repeatable), read into `args.overrides`."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, typed by its field (repeatable), e.g. "
        "--set trainer.lr=1e-5 --set rollout.backend=vllm",
    )


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--nprocs` and `--launcher`, the options of commands that start workers."""
    parser.add_argument("--nprocs", type=int, default=None,
                        help="worker processes on this machine (default: runtime.nprocs)")
    parser.add_argument("--launcher", choices=("elastic", "ray"), default="elastic",
                        help="how workers are started on one machine (default: elastic)")


def add_run_dir_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Adds the RUN_DIR argument (`args.run_dir`): a directory `peerflow train` wrote."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help=help_text)


def add_json_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Adds `--json` (`args.json`, a flag): print JSON in place of the text for people."""
    parser.add_argument("--json", action="store_true", help=help_text)


def add_json_file_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Adds `--json FILE` (`args.json`, `None` when absent): also write the result as JSON."""
    parser.add_argument("--json", metavar="FILE", help=help_text)


def add_trust_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--trust-checkpoint` (`args.trust_checkpoint`, a flag); see `apply_trust`."""
    parser.add_argument(
        "--trust-checkpoint", action="store_true",
        help="load checkpoint files that are pickles the safe loader (torch weights_only) "
        "refuses, unrestricted: such a file runs whatever code it holds. Only for "
        "checkpoints you wrote yourself (e.g. DeepSpeed or Megatron ones of PeerFlow 0.1.0)")


def apply_trust(args: argparse.Namespace) -> None:
    """`--trust-checkpoint`: this process and every worker it starts trust the checkpoint."""
    from peerflow.checkpoint.pickles import trust_checkpoints

    if getattr(args, "trust_checkpoint", False):
        trust_checkpoints(True)
