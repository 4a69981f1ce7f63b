"""`restore_latest` on two ranks: rank 0's refusal of a crafted pickle reaches every rank
(no rank waits for a load that never comes), naming the file; the payload never runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.gloo import run_script

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("refusal_worker.py")


def test_every_rank_refuses_the_crafted_checkpoint_rank_0_found(tmp_path, monkeypatch):
    from peerflow.checkpoint.pickles import TRUST_ENV

    monkeypatch.setenv(TRUST_ENV, "0")
    run_script(WORKER, str(tmp_path), nprocs=2, timeout=120)
    target = tmp_path / "checkpoints" / "step_000001" / "actor" / "optim.pt"
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["resumed"] == 1
        assert result["refusal"] is not None and str(target) in result["refusal"]
        assert "--trust-checkpoint" in result["refusal"]
    assert not (tmp_path / "pwned").exists()
