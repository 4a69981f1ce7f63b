"""A code-RL run on the weaker sandbox fallback says so at start, and scores through it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

CODE_REWARD = str(Path(__file__).resolve().parents[2] / "examples" / "code_reward.yaml")
SHORT = ["run.steps=1", "run.eval_every=0", "run.checkpoint_every=0", "run.prompts_per_step=2",
         "rollout.sampling.n=2", "rollout.sampling.max_tokens=16"]


def test_a_run_on_the_fallback_sandbox_says_so_at_start(tmp_path, peerflow_train, metrics_of):
    run_dir = tmp_path / "run"
    proc = peerflow_train([CODE_REWARD, "--run-dir", str(run_dir)],
                          [*SHORT, "sandbox.backend=audit-hook"])
    assert proc.stderr.count("warning: sandbox.backend=audit-hook") == 1, proc.stderr[-3000:]
    assert "_posixsubprocess.fork_exec" in proc.stderr
    last = metrics_of(run_dir)[-1]
    assert last["reward/errors"] == 0 and "reward/code/mean" in last
