"""`peerflow conformance NAME [--json FILE]`: run the adapter conformance suite."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Adds the `conformance` subcommand."""
    parser = subparsers.add_parser(
        "conformance", help="run the adapter conformance suite for an installed engine",
        description="Runs layers 0-4 of the conformance suite (surface, layout invariants, "
        "CPU round trip against the oracle, real engine, GPU) for a registered rollout or "
        "train engine and prints a results table per layer and capability.",
    )
    parser.add_argument("name", help="registered engine name (see `peerflow plugins`)")
    parser.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    parser.add_argument("-k", dest="keyword", metavar="EXPR",
                        help="only run tests matching this pytest -k expression")
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to pytest (repeatable)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs the suite; exit code 0 when every test passed, skipped or failed as expected."""
    from peerflow.conformance.runner import format_report, run_conformance, write_json

    extra = list(args.pytest_arg)
    if args.keyword:
        extra += ["-k", args.keyword]
    report = run_conformance(args.name, pytest_args=tuple(extra))
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
    return 0 if report["passed"] else 1
