"""Options several benchmarks share: each defined once (`--shape` is `shapes`' own).

A benchmark's `add_arguments` calls these; where the default or the help line depends on
the benchmark (what one repetition is, how many make a figure), it passes its own.
"""

from __future__ import annotations

import argparse


def add_runs_argument(parser: argparse.ArgumentParser, default: int, help_text: str) -> None:
    """Adds `--runs N` (`args.runs`): repetitions, whose median each reported figure is."""
    parser.add_argument("--runs", type=int, default=default, help=help_text)


def add_both_sides_config_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--config` (`args.config`): the run config both sides of a comparison run."""
    parser.add_argument("--config", default="examples/quickstart.yaml",
                        help="run config both sides use (default: the quickstart)")


def add_both_sides_override_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--set KEY=VALUE` (repeatable, `args.overrides`), applied to both sides' config."""
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override applied to both sides")
