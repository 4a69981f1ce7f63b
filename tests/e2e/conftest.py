"""Shared helpers of the end-to-end tests: tiny run settings and metrics reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")

#: Overrides that shrink the quickstart to a few seconds a step on one CPU core.
TINY = [
    "run.steps=2", "run.prompts_per_step=4", "rollout.sampling.n=4",
    "rollout.sampling.max_tokens=4", "run.checkpoint_every=0", "run.tensorboard=false",
    "run.trace=false", "model.builder_options.hidden_size=32",
    "model.builder_options.intermediate_size=64", "model.builder_options.num_layers=1",
]


def read_metrics(run_dir: Path) -> list[dict]:
    """Returns the lines of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


@pytest.fixture(autouse=True)
def _model_cache(tmp_path_factory, monkeypatch):
    """Builds tiny models into one cache shared by the e2e tests (not the user's)."""
    cache = tmp_path_factory.getbasetemp() / "model-cache"
    monkeypatch.setenv("PEERFLOW_MODEL_CACHE", str(cache))


@pytest.fixture
def quickstart() -> str:
    """Path of examples/quickstart.yaml."""
    return QUICKSTART


@pytest.fixture
def tiny() -> list[str]:
    """Overrides that make the quickstart tiny."""
    return list(TINY)


@pytest.fixture
def metrics_of():
    """`metrics_of(run_dir)` reads a run's metrics.jsonl."""
    return read_metrics


def run_train(args: list[str], overrides: list[str] = ()) -> subprocess.CompletedProcess:
    """Runs `peerflow train ARGS --set …` in a fresh process and checks it succeeded."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "peerflow", "train", *args]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture
def peerflow_train():
    """`peerflow_train(args, overrides)` runs `peerflow train` in a subprocess."""
    return run_train


#: The shared 2-process run: 4 steps, checkpoints at steps 2 and 4, traced.
SHARED_RUN = [*TINY, "run.steps=4", "run.checkpoint_every=2", "run.trace=true"]


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> Path:
    """One `peerflow train` of the tiny quickstart on 2 processes (`SHARED_RUN`), run once.

    test_quickstart checks its outputs and test_resume takes it as the uninterrupted run:
    a session-scoped run does not see the function-scoped model cache, so it sets it.
    What the command printed (stdout, then stderr) is kept beside the run directory, in
    `terminal.txt`.
    """
    run_dir = tmp_path_factory.mktemp("quickstart-run") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PEERFLOW_MODEL_CACHE",
                     str(tmp_path_factory.getbasetemp() / "model-cache"))
        proc = run_train([QUICKSTART, "--nprocs", "2", "--run-dir", str(run_dir)], SHARED_RUN)
    (run_dir.parent / "terminal.txt").write_text(proc.stdout + proc.stderr)
    return run_dir
