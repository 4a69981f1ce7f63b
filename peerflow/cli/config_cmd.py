"""`peerflow config validate|show FILE [--set k=v …]` and `peerflow config reference`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from peerflow.cli.options import add_config_arguments

HELP = "validate or show a run config"
DESCRIPTION = "Check a run config against the installed plugins, or print it resolved."


def load_validated(args: argparse.Namespace) -> Any:
    """Loads, overrides and validates a config; opens its model directory and dataset.

    Every problem is reported at once: the structure's (unknown keys, types, values) and
    the checks against the installed plugins, in one `ConfigError`.
    """
    from peerflow.config import load_config, validate_config
    from peerflow.config.extras import launcher_problem
    from peerflow.errors import ConfigError
    from peerflow.launch.preflight import preflight
    from peerflow.plugins import get_plugin_manager

    problems: list[str] = []
    config = load_config(args.config, args.overrides, problems=problems)
    launcher = launcher_problem(getattr(args, "launcher", "elastic"))
    problems += [launcher] if launcher else []
    pm = get_plugin_manager()
    try:
        validate_config(config, pm)
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    preflight(config, pm)
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the actions `validate`, `show` and `reference`."""
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    validate = sub.add_parser("validate", help="exit non-zero with every problem found")
    add_config_arguments(validate)
    validate.add_argument("--launcher", choices=("elastic", "ray"), default="elastic",
                          help="also check what `peerflow train --launcher` needs (Ray)")
    validate.set_defaults(func=run_validate)
    show = sub.add_parser("show", help="print the resolved config (defaults filled in)")
    add_config_arguments(show)
    show.set_defaults(func=run_show)
    reference = sub.add_parser(
        "reference", help="print every config key (type, default, meaning) as Markdown",
        description="Print the config reference (docs/config.md) generated from the config "
        "classes and the options classes of the built-in engines, tasks and algorithms.")
    reference.set_defaults(func=run_reference)


def run_validate(args: argparse.Namespace) -> int:
    """Validates a config; prints `ok` or raises `ConfigError` (exit 1)."""
    from peerflow.plugins import get_plugin_manager
    from peerflow.rewards.model_code import fallback_notice

    notice = fallback_notice(load_validated(args), get_plugin_manager())
    if notice:
        print(notice, file=sys.stderr)
    print(f"{args.config}: ok")
    return 0


def run_show(args: argparse.Namespace) -> int:
    """Prints the resolved config as YAML."""
    from peerflow.config import dump_config

    print(dump_config(load_validated(args)), end="")
    return 0


def run_reference(args: argparse.Namespace) -> int:
    """Prints the config reference as Markdown."""
    from peerflow.config.reference import render
    from peerflow.plugins import get_plugin_manager

    print(render(get_plugin_manager()), end="")
    return 0
