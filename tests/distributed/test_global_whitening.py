"""REINFORCE++/GAE whitening is global over dp-ranks, also when tp peers replicate shards.

Four gloo processes laid out as dp=2 × tp=2: the two tp peers of a dp-rank hold the
same samples. Whitening over the whole group with `replicas=2` must give, on every rank,
exactly what whitening the union of the two dp-shards in one process gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from peerflow.algorithms.ragged_ops import whiten
from tests.helpers.gloo import free_port, init_gloo

pytestmark = pytest.mark.distributed

SHARDS = [torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.float64),
          torch.tensor([1.0, -4.0, 0.25], dtype=torch.float64)]


def _worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        shard = SHARDS[rank // 2]  # ranks 0, 1: dp-rank 0 (tp peers); 2, 3: dp-rank 1
        results.put((rank, whiten(shard, dist.group.WORLD, replicas=2).tolist()))  # plain data: the
        # parent may read it after this process exited (a shared tensor's fd would be gone)
    finally:
        dist.destroy_process_group()


def test_whitening_counts_each_dp_shard_once():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 4, port, results)) for r in range(4)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = whiten(torch.cat(SHARDS))
    for rank in range(4):
        want = expected[:4] if rank < 2 else expected[4:]
        torch.testing.assert_close(torch.tensor(got[rank], dtype=torch.float64), want, rtol=0,
                                   atol=1e-12)
