"""`peerflow conformance NAME [--json FILE]`: run the adapter conformance suite.

The suite is a pytest suite shipped in `peerflow.conformance`; this command checks the
name against the plugin registries, then runs pytest on it in a subprocess (so the core
never imports the suite) with the suite's `--peerflow-table` / `--peerflow-report`
options, and passes its output through. `--emulate-device` runs that subprocess with
`PEERFLOW_EMULATE_ACCELERATOR=1`, so the engine computes on the emulated accelerator
(docs/device-emulation.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from peerflow.cli.options import add_json_file_option

#: The pytest module the command runs (classes pick the adapter from the option).
SUITE_MODULE = "peerflow.conformance.cli_suite"


HELP = "run the adapter conformance suite for an installed engine"
DESCRIPTION = ("Runs layers 0-4 of the conformance suite (surface, layout invariants, CPU "
               "round trip against the oracle, real engine, GPU) for a registered rollout or "
               "train engine and prints a results table per layer and capability.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds NAME, `--json FILE`, `-k`, `--pytest-arg` and `--emulate-device`."""
    parser.add_argument("name", help="registered engine name (see `peerflow plugins`)")
    add_json_file_option(parser, "also write a machine-readable report")
    parser.add_argument("-k", dest="keyword", metavar="EXPR",
                        help="only run tests matching this pytest -k expression")
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to pytest (repeatable)")
    parser.add_argument("--emulate-device", action="store_true",
                        help="run on the emulated accelerator (peerflow.testing): a CPU device "
                        "that refuses every host/device mix a GPU refuses, for authors "
                        "without a GPU (docs/device-emulation.md)")


def run(args: argparse.Namespace) -> int:
    """Runs the suite; exit code 0 when no test failed (skips and declared xfails allowed).

    Raises:
        ConfigError: pytest is not installed (the `conformance` extra).
        UnknownNameError: no rollout or train engine is registered as `args.name`.
    """
    import importlib.util

    from peerflow.errors import ConfigError
    from peerflow.plugins import get_plugin_manager

    if importlib.util.find_spec("pytest") is None:
        raise ConfigError("peerflow conformance runs its suite through pytest, which is not "
                          "installed here; pip install 'peerflow[conformance]'.")
    pm = get_plugin_manager()
    if not any(args.name in pm.registry(kind) for kind in ("rollout_engine", "train_engine")):
        pm.registry("rollout_engine").get(args.name)  # raises, listing what is installed
    with tempfile.TemporaryDirectory(prefix="peerflow-conformance-") as tmp:
        command = [sys.executable, "-m", "pytest", "--pyargs", SUITE_MODULE,
                   "--peerflow-adapter", args.name, "--peerflow-table",
                   "-p", "no:cacheprovider", "-q", "--no-header", "--tb=line", "-o", "addopts=",
                   "--rootdir", tmp, "--basetemp", str(Path(tmp) / "t")]
        if args.json:
            command += ["--peerflow-report", str(Path(args.json).resolve())]
        if args.keyword:
            command += ["-k", args.keyword]
        command += list(args.pytest_arg)
        env = dict(os.environ, PEERFLOW_EMULATE_ACCELERATOR="1") if args.emulate_device else None
        result = subprocess.run(command, cwd=tmp, check=False, env=env)
    return 0 if result.returncode == 0 else 1
