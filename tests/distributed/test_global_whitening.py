"""REINFORCE++/GAE whitening is global over dp-ranks, also when tp peers replicate shards.

Four gloo processes laid out as dp=2 × tp=2: the two tp peers of a dp-rank hold the
same samples. Whitening over the whole group with `replicas=2` must give, on every rank,
exactly what whitening the union of the two dp-shards in one process gives.
"""

from __future__ import annotations

import pytest
import torch

from peerflow.algorithms.ragged_ops import whiten
from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed

SHARDS = [torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.float64),
          torch.tensor([1.0, -4.0, 0.25], dtype=torch.float64)]


def _worker(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    shard = SHARDS[rank // 2]  # ranks 0, 1: dp-rank 0 (tp peers); 2, 3: dp-rank 1
    return whiten(shard, dist.group.WORLD, replicas=2).tolist()


def test_whitening_counts_each_dp_shard_once():
    got = run_gloo(_worker, 4, timeout_s=60)
    expected = whiten(torch.cat(SHARDS))
    for rank in range(4):
        want = expected[:4] if rank < 2 else expected[4:]
        torch.testing.assert_close(torch.tensor(got[rank], dtype=torch.float64), want, rtol=0,
                                   atol=1e-12)
