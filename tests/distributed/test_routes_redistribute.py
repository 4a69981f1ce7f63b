"""Routes as data: the `routed_experts` field moves through the coordinator like token ids."""

from __future__ import annotations

import pytest
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.coordinator import dp_members, pack_batch
from peerflow.layout import ParallelLayout
from peerflow.routes import ROUTES, route_bytes
from tests.distributed.test_coordinator import Pool, check

pytestmark = pytest.mark.distributed


def _shard(dp: int, samples: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = list(range(dp * 100, dp * 100 + samples))
    batch = Batch(sample_id=ids, group_id=[i // 2 for i in ids], weight_version=[0] * samples)
    prompts = [torch.randint(0, 50, (int(torch.randint(1, 5, (1,), generator=gen)),),
                             generator=gen) for _ in ids]
    answers = [torch.randint(0, 50, (int(torch.randint(0, 9, (1,), generator=gen)),),
                             generator=gen) for _ in ids]
    batch.set("prompt_ids", RaggedField.from_tensors(prompts, dtype=torch.int64))
    batch.set("response_ids", RaggedField.from_tensors(answers, dtype=torch.int64))
    routes = []
    for p, a in zip(prompts, answers, strict=True):
        row = torch.randint(-1, 8, (len(p) + len(a), 3, 2), generator=gen).to(torch.int16)
        row[:, 1] = -1  # a dense layer
        routes.append(row)
    batch.set(ROUTES, RaggedField.from_tensors(routes, dtype=torch.int16))
    return batch


@pytest.mark.parametrize("mode", ["p2p", "centralized"])
def test_routes_reshard_byte_exact_with_their_samples(mode):
    src, dst = ParallelLayout(dp=2), ParallelLayout(dp=1, tp=2)
    shards_by_dp = [_shard(0, 5, 1), _shard(1, 4, 2)]
    shards = {r: pack_batch(shards_by_dp[dp]) for dp, ranks in enumerate(dp_members(src))
              for r in ranks}
    pool = Pool(2)
    try:
        out = pool.run(src, dst, shards, mode=mode)
    finally:
        pool.close()
    check(src, dst, shards_by_dp, out)  # every field byte-exact, every sample once
    received = out[0][0]
    assert received.ragged(ROUTES).values.dtype == torch.int16
    assert received.ragged(ROUTES).values.shape[1:] == (3, 2)
    assert route_bytes(received) == sum(route_bytes(b) for b in shards_by_dp) - 8
