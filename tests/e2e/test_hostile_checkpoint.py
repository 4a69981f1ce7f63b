"""A crafted pickle in a DeepSpeed run's checkpoint, through the real commands: `peerflow
train --resume`, `peerflow eval --checkpoint` (run and step directory) and `peerflow
export` refuse it naming the file and `--trust-checkpoint`; `peerflow checkpoints` says
`untrusted`; the `touch MARKER` payload never runs.

Slow (a one-step DeepSpeed quickstart and three more launches): the default run keeps
the contract with `test_crafted_pickle_in_the_checkpoint_is_refused_by_name_and_never_runs`
(tests/engines/deepspeed/test_deepspeed_engine.py) and tests/unit/test_checkpoint_pickles.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import QUICKSTART, TINY
from tests.helpers.hostile import forge_manifest, plant

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
pytest.importorskip("deepspeed")


def _peerflow(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "PEERFLOW_TRUST_CHECKPOINT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "peerflow", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_resume_eval_and_export_refuse_a_crafted_deepspeed_checkpoint(tmp_path, peerflow_train):
    run = tmp_path / "run"
    overrides = [*TINY, "run.steps=1", "run.checkpoint_every=1", "trainer.backend=deepspeed"]
    peerflow_train([QUICKSTART, "--run-dir", str(run), "--nprocs", "1"], overrides)
    step = run / "checkpoints" / "step_000001"
    target = next(step.rglob("*_optim_states.pt"))
    marker = tmp_path / "pwned"
    plant(target, marker)
    forge_manifest(step)
    attempts = {
        "resume": _peerflow("train", "--resume", str(run), "--set", "run.steps=2"),
        "eval": _peerflow("eval", str(run / "config.yaml"), "--checkpoint", str(run),
                          "--out", str(tmp_path / "eval")),
        "eval step": _peerflow("eval", str(run / "config.yaml"), "--checkpoint", str(step),
                               "--out", str(tmp_path / "eval-step")),
        "export": _peerflow("export", str(run), str(tmp_path / "model")),
    }
    for name, proc in attempts.items():
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"{name} went ahead: {output[-2000:]}"
        assert str(target) in output and "--trust-checkpoint" in output, output[-2000:]
    listed = _peerflow("checkpoints", str(run))
    assert "untrusted" in listed.stdout and listed.returncode == 1
    assert not marker.exists(), "the payload ran"
    assert not Path(tmp_path / "model").exists()
