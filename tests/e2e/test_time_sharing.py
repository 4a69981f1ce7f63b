"""Colocated placement time-shares the rollout engine: sleep after generating, wake to sync.

Two engines subclass the real `hf` rollout engine and record every call. `sleepy-hf`
declares `Capabilities.sleep` and really frees its weights while asleep (a level-1 sleep:
offloaded, restored on `wake`), so a sync or a generation in the wrong order fails the
run. `plain-hf` declares nothing and must see no sleep or wake at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import pytest
import torch

from peerflow.adapters.hf.engine import HFRolloutEngine
from peerflow.plugins import hookimpl
from tests.helpers.gloo import warm_process

pytestmark = pytest.mark.distributed

RECORD_ENV = "PEERFLOW_TEST_SLEEP_RECORD"


class _Recording:
    def _record(self, *call):
        with open(os.environ[RECORD_ENV], "a") as f:
            f.write(json.dumps(call) + "\n")

    def generate(self, requests, sampling):
        self._record("generate")
        return super().generate(requests, sampling)

    def load_weights(self, items):
        self._record("load")
        return super().load_weights(items)


class SleepyHF(_Recording, HFRolloutEngine):
    """The hf engine with a level-1 sleep: weights offloaded while asleep."""

    name = "sleepy-hf"
    capabilities = attrs.evolve(HFRolloutEngine.capabilities, sleep=True)

    def sleep(self):
        self._record("sleep")
        self._offloaded = {}
        for name, param in self._params.items():
            self._offloaded[name] = param.data
            param.data = torch.empty(0, dtype=param.dtype)

    def wake(self, tags=None):
        self._record("wake", *(tags or ()))
        if tags is None or "weights" in tags:
            for name, param in self._params.items():
                param.data = self._offloaded.pop(name)


class PlainHF(_Recording, HFRolloutEngine):
    """The hf engine, recording sleep/wake calls it does not declare."""

    name = "plain-hf"

    def sleep(self):
        self._record("sleep")

    def wake(self, tags=None):
        self._record("wake")


class _Plugin:
    @hookimpl
    def peerflow_register_rollout_engines(self, register):
        register(SleepyHF)
        register(PlainHF)


def _run(quickstart, overrides, run_dir, record, cache):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    os.environ.update(GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                      PEERFLOW_MODEL_CACHE=cache, **{RECORD_ENV: record})
    from peerflow.plugins import get_plugin_manager
    from peerflow.worker.main import run_worker

    get_plugin_manager().register(_Plugin(), "test-time-sharing")
    run_worker(quickstart, overrides, run_dir)


@pytest.mark.parametrize("backend", ["sleepy-hf", "plain-hf"])
def test_colocated_run_sleeps_and_wakes_only_a_declaring_engine(tmp_path, quickstart, tiny,
                                                               backend, metrics_of):
    record = tmp_path / "calls.jsonl"
    overrides = [*tiny, "run.steps=3", "runtime.nprocs=1", f"rollout.backend={backend}"]
    proc = warm_process(_run, (quickstart, overrides, str(tmp_path / "run"), str(record),
                               os.environ["PEERFLOW_MODEL_CACHE"]))
    proc.start()
    proc.join(300)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0
    assert [m["step"] for m in metrics_of(tmp_path / "run")] == [1, 2, 3]
    calls = [tuple(json.loads(line)) for line in Path(record).read_text().splitlines()]
    loads = sum(1 for c in calls if c == ("load",))
    assert loads >= 3  # one sync a step, at least one bucket each
    compact = [c for i, c in enumerate(calls) if c != ("load",) or calls[i - 1] != ("load",)]
    if backend == "plain-hf":
        assert ("sleep",) not in calls and ("wake",) not in calls
        assert compact == [("generate",), ("load",)] * 3
    else:  # verl's hybrid-engine order, every step
        step = [("generate",), ("sleep",), ("wake", "weights"), ("load",),
                ("wake", "kv_cache")]
        assert compact == step * 3
