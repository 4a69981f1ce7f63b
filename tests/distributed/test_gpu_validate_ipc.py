"""The GPU kit's colocated weight-sync check (`scripts/gpu_validate_ipc.py`) on CPU.

On the GPU it runs `cuda_ipc`; here the same code path (plan, buckets, `run_plan` with a
kept arena and in-place destination tensors, figures, goal) runs over gloo with a small
parameter set, so the kit's logic is tested where no GPU is lent.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
#: hidden, intermediate, layers, heads, kv heads, vocabulary.
SMALL = (64, 128, 2, 4, 2, 100)


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_validate_ipc",
                                                  SCRIPTS / "gpu_validate_ipc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate_ipc"] = module
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, world: int) -> dict:
    kit = _kit()
    return kit.sync_rank(rank, device="cpu", transport="torch", shapes=kit.param_shapes(SMALL),
                         bucket_bytes=16384, syncs=3)


def test_the_colocated_sync_check_measures_and_verifies_on_cpu():
    kit = _kit()
    got = run_gloo(_rank, 2, timeout_s=60)
    figures, status = kit.ipc_figures(got[0], got[1], goal=0.0)
    assert status == 0 and figures["identical"], figures
    assert figures["buckets"] > 1 and len(figures["gb_per_s"]) == 3
    assert figures["bytes"] == 2 * sum(a * b for _, (a, b) in kit.param_shapes(SMALL))
    assert set(figures["best_split_s"]) == {"gather_s", "pack_s", "wire_s", "load_s"}
    slow, status = kit.ipc_figures(got[0], got[1], goal=1e12)
    assert status == 1 and "below the goal" in slow["reason"]
    bad = dict(got[1], digest=got[1]["digest"] + 1)
    assert kit.ipc_figures(got[0], bad, goal=0.0)[1] == 1
