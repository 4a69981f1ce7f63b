"""Every trainer rank sends its share: the planner spreads regions over source replicas."""

from __future__ import annotations

import math

import pytest
import torch

from peerflow.conformance.harness import run_threaded
from peerflow.conformance.oracle import arange_globals, oracle_reshard, shard_all
from peerflow.models import RankCoords, hf_layout, hf_parameters, vllm_layout
from peerflow.reshard import plan_reshard, senders
from peerflow.shard import ShardSpec

CONFIG = dict(model_type="qwen3", vocab_size=130, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=4)


def _trainers(sharded: bool) -> dict[int, list[ShardSpec]]:
    """Trainer dp = 2 on ranks 0 and 1: whole replicated tensors, or FSDP shards."""
    if sharded:
        return {r: hf_layout(CONFIG, shard_rank=r, shard_size=2) for r in range(2)}
    return {r: hf_layout(CONFIG, RankCoords(dp_rank=r)) for r in range(2)}


def _rollout(first: int) -> dict[int, list[ShardSpec]]:
    """vLLM tp = 2 on ranks `first` and `first + 1`."""
    return {first + r: vllm_layout(CONFIG, RankCoords(tp_rank=r, tp_size=2)) for r in range(2)}


def _nbytes(specs) -> int:
    return sum(math.prod(s.local_shape) * senders.itemsize(s.dtype) for s in specs)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fsdp"])
@pytest.mark.parametrize("first", [2, 0], ids=["split", "colocated"])
def test_dp2_to_tp2_every_trainer_rank_sends_its_share(sharded, first):
    src, dst = _trainers(sharded), _rollout(first)
    plan = plan_reshard(src, dst)
    assert plan.senders == 2 and plan.sender_share <= 0.6, plan.sender_bytes()
    model = sum(math.prod(s) * 4 for s in hf_parameters(CONFIG).values())
    assert max(plan.sender_bytes().values()) < model  # no rank sends the whole model
    full = arange_globals(hf_parameters(CONFIG))
    got, stats = run_threaded(plan, shard_all(src, full), bucket_bytes=4096)
    want = oracle_reshard(src, shard_all(src, full), dst)
    for rank, tensors in want.items():
        for name, tensor in tensors.items():
            assert torch.equal(got[rank][name], tensor), (rank, name)
    for rank, specs in dst.items():  # a tp rank receives its shard only, never the model
        received = sum(t.numel * 4 for t in plan.receives_of(rank))
        assert received <= _nbytes(specs) < model
        assert stats[rank].sender_share == plan.sender_share
    if first == 0:  # colocated: what a rank holds itself is copied, not sent
        assert all(t.src_rank == t.dst_rank for t in plan.transfers
                   if t.dst_rank in plan.sources and not sharded)


def test_one_large_replicated_tensor_is_cut_into_a_slab_per_holder(monkeypatch):
    monkeypatch.setattr(senders, "MIN_SLAB_BYTES", 64)
    spec = ShardSpec.of_slice("w", (64, 8))
    src = {0: [spec], 1: [ShardSpec.of_slice("w", (64, 8), replica=1)],
           2: [ShardSpec.of_slice("w", (64, 8), replica=2)]}
    plan = plan_reshard(src, {3: [spec]})
    assert sorted(plan.sender_bytes().values()) == [672, 672, 704]
    got, _ = run_threaded(plan, shard_all(src, arange_globals({"w": (64, 8)})))
    assert torch.equal(got[3]["w"], arange_globals({"w": (64, 8)})["w"])


def test_without_balance_only_replica_zero_sends():
    plan = plan_reshard(_trainers(False), _rollout(2), balance=False)
    assert plan.senders == 1 and plan.sender_share == 1.0


def test_the_plan_is_the_same_whatever_order_the_ranks_come_in():
    src, dst = _trainers(False), _rollout(2)
    shuffled = {r: src[r] for r in reversed(src)}
    assert plan_reshard(src, dst).transfers == plan_reshard(shuffled, dst).transfers
