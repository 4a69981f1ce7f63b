"""`peerflow bench NAME [options] [--json FILE]`: benchmarks that print JSON.

A benchmark is a module under `peerflow.bench` listed in `BENCHMARKS`; it defines
`add_arguments(parser)` and `run(args) -> dict`. Ratios are measured side by side in one
run, and each result says how many repetitions its figures are the median of.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from peerflow.cli.options import add_json_file_option

#: Benchmark name → module under `peerflow.bench`.
BENCHMARKS: dict[str, str] = {
    "reshard": "reshard",
    "coordinator": "coordinator",
    "e2e": "e2e",
    "rollout": "rollout",
    "weight-sync": "weight_sync",
    "async": "async_stream",
    "train": "train",
    "sandbox": "sandbox",
    "moe": "moe",
}


HELP = "run a benchmark and print JSON"
DESCRIPTION = ("Benchmarks print JSON; ratios are measured side by side in one run. Run them "
               "on an otherwise idle machine.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one sub-command per benchmark (help: the first line of its module docstring)."""
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, module in BENCHMARKS.items():
        try:
            bench = importlib.import_module(f"peerflow.bench.{module}")
        except ModuleNotFoundError:
            continue
        bench_parser = sub.add_parser(name, help=(bench.__doc__ or "").strip().splitlines()[0])
        add_json_file_option(bench_parser, "also write the JSON here")
        bench.add_arguments(bench_parser)
        bench_parser.set_defaults(func=_runner(bench))


def _runner(bench: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        result = bench.run(args)
        text = json.dumps(result, indent=2)
        print(text)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
        return 0

    return run
