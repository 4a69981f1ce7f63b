"""Runs the `on_device_*.py` modules in a pytest process of their own, on the emulated device.

The emulation (`peerflow.testing.emulated_device`) is process-wide and cannot be undone,
so these modules never run in the shared test workers: each gets a fresh interpreter with
`PEERFLOW_EMULATE_ACCELERATOR=1`, where `tests/device/conftest.py` installs it first.
A failure shows the inner run's report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerflow.testing.autoload import ENV_VAR as EMULATE_ENV

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODULES = sorted(p.name for p in HERE.glob("on_device_*.py"))


def _skip_without_emulation() -> None:
    from peerflow.testing.emulated_device import unsupported_reason

    reason = unsupported_reason()
    if reason:
        pytest.skip(reason)


def run_emulated_pytest(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m pytest ARGS` in a fresh process on the emulated accelerator."""
    env = dict(os.environ, **{EMULATE_ENV: "1"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5",
         "-o", "addopts=", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("module", MODULES)
def test_module_passes_on_the_emulated_device(module):
    _skip_without_emulation()
    proc = run_emulated_pytest(str(HERE / module))
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, report
