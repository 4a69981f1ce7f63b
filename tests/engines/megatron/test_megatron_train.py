"""`peerflow train examples/quickstart.yaml --set trainer.backend=megatron`, end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.deepspeed.trainrun import LEARN_STEPS, reward_gain, train  # noqa: E402

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed


# pp=2 learning is in the slow tier: test_megatron_engine.py checks pp=2 steps against
# one rank in every run.
@pytest.mark.parametrize("layout", ["trainer.layout.tp=2", pytest.param(
    "trainer.layout.pp=2", marks=pytest.mark.slow)])
def test_quickstart_learns_with_megatron(tmp_path, layout):
    lines = train("megatron", tmp_path / "run", f"run.steps={LEARN_STEPS}",
                  "run.checkpoint_every=0", layout, cache=tmp_path / "models")
    assert [m["step"] for m in lines] == list(range(1, LEARN_STEPS + 1))
    first, last = reward_gain(lines)
    assert last > first + 0.05, f"reward did not improve: {first:.3f} -> {last:.3f}"
