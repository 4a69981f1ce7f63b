"""`all_gather_values`: PeerFlow's object gathers without torch's pickle (issue 49).

`torch.distributed.all_gather_object` unpickles what every peer sends; the gathers PeerFlow
makes itself (sample records, metric names, trained groups, shared prompts, hosts) go
through `peerflow.distributed.comm.all_gather_values`, which decodes with the wire codec.
A rank that sends a crafted pickle instead makes the others raise `WireFormatError`; the
payload's marker file never appears.
"""

from __future__ import annotations

import pickle

import pytest

from tests.helpers.gloo import run_gloo
from tests.helpers.hostile import Payload

pytestmark = pytest.mark.distributed


def _gather(rank: int, world: int, marker: str = "") -> object:
    from peerflow.distributed import comm
    from peerflow.wirecodec import WireFormatError

    value = {"rank": rank, "names": ("reward/mean", "mean", 0.5), 7: [rank] * rank}
    if marker and rank == 1:  # this rank sends a pickle where its encoded value belongs
        comm.encode = lambda _value: pickle.dumps(Payload(marker))
    try:
        return comm.all_gather_values(value, what="test gather", timeout=30)
    except WireFormatError as exc:
        return f"refused: {exc}"


def _attacked(rank: int, world: int) -> object:
    import os

    return _gather(rank, world, os.environ["PEERFLOW_TEST_MARKER"])


def test_every_rank_gets_every_value_in_rank_order():
    got = run_gloo(_gather, 3, timeout_s=60)
    want = [{"rank": r, "names": ("reward/mean", "mean", 0.5), 7: [r] * r} for r in range(3)]
    assert got == {r: want for r in range(3)}


def test_a_peer_sending_a_pickle_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PEERFLOW_TEST_MARKER", str(marker))
    got = run_gloo(_attacked, 2, timeout_s=60)
    assert all("refused" in got[r] and "test gather (group rank 1)" in got[r] for r in got)
    assert not marker.exists()
