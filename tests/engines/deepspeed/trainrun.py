"""Runs `peerflow train examples/quickstart.yaml` with a chosen trainer backend (tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
#: Steps of the learning check: the quickstart's reward climbs from ~0.09 (steps 1-5) to
#: ~0.2 by step 20 with every backend (measured: deepspeed 0.085 -> 0.51 and megatron
#: 0.086 -> 0.43+ over the full quickstart), while a 5-step mean carries ~±0.03 of noise.
LEARN_STEPS = 20


def train(backend: str, run_dir: Path, *overrides: str, resume: bool = False,
          cache: Path | None = None) -> list[dict]:
    """Runs the quickstart with `trainer.backend=backend`; returns its metrics lines."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    if cache is not None:
        env["PEERFLOW_MODEL_CACHE"] = str(cache)
    args = ["--resume", str(run_dir)] if resume else \
        [QUICKSTART, "--run-dir", str(run_dir), "--set", f"trainer.backend={backend}"]
    cmd = [sys.executable, "-m", "peerflow", "train", *args, "--nprocs", "2"]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def reward_gain(lines: list[dict], window: int = 5) -> tuple[float, float]:
    """Mean reward of the first and of the last `window` steps."""
    rewards = [m["reward/mean"] for m in lines if "reward/mean" in m]
    return sum(rewards[:window]) / window, sum(rewards[-window:]) / window
