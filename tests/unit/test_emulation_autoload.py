"""The emulated accelerator reaches a process through torch's device-extension hook only.

Production code never imports `peerflow.testing` (`test_dependency_rules.py`); with
`PEERFLOW_EMULATE_ACCELERATOR=1` torch loads `peerflow.testing.autoload:arm`, and the first
`torch.accelerator` question asked outside an import installs the emulation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from peerflow.testing.autoload import ENV_VAR

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import torch
import transformers  # asks torch.accelerator while importing: answered as the host's
before = "peerflow.testing.emulated_device" in sys.modules
from peerflow.distributed import devices
device = devices.rank_device()
print("RESULT:" + json.dumps(dict(before=before, device=str(device),
                                  backend=devices.group_backend())))
"""


def _child(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "LOCAL_WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          cwd=ROOT, env={**environ, **env}, timeout=240, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT:")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT:"):])


def test_the_hook_is_registered_with_torch():
    names = {ep.value for ep in entry_points(group="torch.backends")}
    assert "peerflow.testing.autoload:arm" in names, (
        "the torch.backends entry point of pyproject.toml is not installed; reinstall "
        "PeerFlow (`pip install -e .`), and remove a stale peerflow.egg-info beside it")


def test_first_question_outside_an_import_installs_the_emulation():
    seen = _child(**{ENV_VAR: "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert seen == dict(before=False, device="emu:1", backend="cpu:gloo,emu:emunccl")


def test_without_the_variable_nothing_changes():
    assert _child()["device"] == "cpu"
