"""`peerflow train examples/quickstart.yaml` with 2 processes, shrunk to a smoke run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


def test_quickstart_two_processes(quickstart_run, metrics_of):
    run_dir = quickstart_run  # 4 steps, checkpoints every 2, traced (shared with test_resume)
    lines = metrics_of(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert 0.0 <= m["reward/mean"] <= 1.0
        assert m["samples"] == 16  # 4 prompts × 4 answers, split over 2 ranks
        assert m["rollout/prompts"] == 4
        assert m["throughput/tokens_per_s"] > 0
        for phase in ("generate", "reward", "advantage", "train_actor", "sync_weights",
                      "step"):
            assert m[f"time/{phase}"] >= 0
        assert m["time/iteration"] >= m["time/step"]  # the loop's span holds the step
        assert 0 < m["memory/peak_rss_gib"] < 64  # the step's peak, largest over ranks
        assert "time/old_logprob" not in m  # on-policy: the fast path skips that forward
        assert m["mismatch/abs_max"] < 1e-4  # rollout and trainer agree at the same weights
        assert 0 < m["off_policy/is_weight_mean"] < 2
        assert 0.0 <= m["reward/frac_zero_std"] <= 1.0  # groups without a learning signal
        # the fsdp trainer runs a prompt once for its answers, so the re-balance before it
        # weighs a rank's 2 groups as their 8 answers and 2 prompts (~5 tokens each), not
        # as 8 × (answer + prompt): ~10 tokens over the answers, not ~40
        over_answers = m["balance/tokens_mean"] - 8 * m["response_length/mean"]
        assert 0 < over_answers < 20, over_answers
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "trace_rank0.json").is_file() and (run_dir / "trace_rank1.json").is_file()
    for step in (2, 4):
        assert (run_dir / "checkpoints" / f"step_00000{step}" / "MANIFEST.json").is_file()
    assert (run_dir / "fingerprint.json").is_file()
    # the rank log says which micro-batches the trainer runs (sdpa: padded, and why)
    assert "padding-free micro-batches off" in (run_dir / "logs" / "rank0.log").read_text()
    assert not (run_dir / "run.lock").exists()  # released when the run ends


def test_bad_config_fails_before_spawning(tmp_path, quickstart):
    proc = subprocess.run(
        [sys.executable, "-m", "peerflow", "train", quickstart, "--run-dir",
         str(tmp_path / "r"), "--set", "algorithm.advantage=grop"],
        capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert proc.returncode == 1
    assert "grop" in proc.stderr and "grpo" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_quickstart_learns(tmp_path, quickstart, metrics_of, peerflow_train):
    """The full quickstart (100 steps, 2 processes): last-5 mean reward ≥ first-5 + 0.3."""
    run_dir = tmp_path / "run"
    peerflow_train([quickstart, "--run-dir", str(run_dir)], ["run.trace=false"])
    rewards = [m["reward/mean"] for m in metrics_of(run_dir)]
    assert len(rewards) == 100
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, (first, last)
