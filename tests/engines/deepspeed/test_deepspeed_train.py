"""`peerflow train examples/quickstart.yaml --set trainer.backend=deepspeed`, end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.deepspeed.trainrun import LEARN_STEPS, reward_gain, train  # noqa: E402

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed


def test_quickstart_learns_and_resumes_with_deepspeed(tmp_path):
    run_dir = tmp_path / "run"
    lines = train("deepspeed", run_dir, f"run.steps={LEARN_STEPS - 2}",
                  "run.checkpoint_every=9", "trainer.deepspeed.zero_stage=3",
                  cache=tmp_path / "models")
    ckpt = run_dir / "checkpoints" / "step_000009" / "actor" / "peerflow_deepspeed.json"
    assert ckpt.is_file(), "DeepSpeed's checkpoint lives in PeerFlow's run directory"
    lines = train("deepspeed", run_dir, f"run.steps={LEARN_STEPS}", resume=True,
                  cache=tmp_path / "models")
    assert [m["step"] for m in lines] == list(range(1, LEARN_STEPS + 1))
    first, last = reward_gain(lines)
    assert last > first + 0.05, f"reward did not improve: {first:.3f} -> {last:.3f}"
    assert all(m["actor/grad_norm"] > 0 for m in lines)
