"""A destination tensor larger than a bucket is streamed in slices within the bucket bound."""

from __future__ import annotations

import pytest
import torch

from peerflow.conformance.harness import run_threaded
from peerflow.conformance.oracle import arange_globals, shard_all
from peerflow.reshard import WeightSyncService, make_buckets, plan_reshard
from peerflow.shard import ShardSpec
from tests.helpers.tensor_engines import TensorRollout, TensorTrainer

SHAPE, BUCKET = (256, 64), 8192  # a 64 KiB fused tensor, 8 KiB buckets
FULL = arange_globals({"w": SHAPE})


class ZeroCopy(TensorRollout):
    """Hands the executor its own tensors to write into (`weight_buffers`)."""

    def weight_buffers(self, specs):
        return [self.params[s.local_name] for s in specs]


def _plan():
    spec = ShardSpec.of_slice("w", SHAPE)
    return spec, plan_reshard({0: [spec]}, {1: [spec]})


def test_buckets_slice_the_tensor_and_load_it_after_the_last_slice():
    _, plan = _plan()
    buckets = make_buckets(plan, BUCKET)
    assert len(buckets) == 8 and all(b.nbytes <= BUCKET for b in buckets)
    assert [b.part for b in buckets] == [(i, 8) for i in range(8)]
    assert [bool(b.loads) for b in buckets] == [False] * 7 + [True]


@pytest.mark.parametrize("engine", [ZeroCopy, TensorRollout], ids=["in-place", "staged"])
def test_a_large_tensor_moves_within_two_buckets_of_extra_memory(engine):
    spec, plan = _plan()
    rollout = engine([spec])
    _, stats = run_threaded(plan, shard_all(plan.sources, FULL), bucket_bytes=BUCKET,
                            engines={1: rollout})
    assert torch.equal(rollout.params["w"], FULL["w"]) and rollout.calls == [1]
    tensor = FULL["w"].numel() * 4
    staged = 0 if engine is ZeroCopy else tensor
    assert stats[0].peak_extra_bytes <= 2 * BUCKET < tensor  # the sender: slices only
    assert stats[1].peak_extra_bytes <= staged + 2 * BUCKET


def test_the_sources_are_materialised_once_for_all_slices_in_both_schedules():
    spec = ShardSpec.of_slice("w", SHAPE)
    plan = plan_reshard({0: [spec]}, {0: [spec]})  # colocated: one process holds both
    trainer = TensorTrainer([spec], {"w": FULL["w"]})
    rollout = ZeroCopy([spec])
    service = WeightSyncService.build(trainer, rollout, plan=plan, bucket_bytes=BUCKET,
                                      transport="inprocess")
    service.sync(1)
    assert trainer.materialized == [["w"]] and torch.equal(rollout.params["w"], FULL["w"])
    trainer.tensors["w"] = FULL["w"] * 2  # streaming: pack, transfer, apply
    service.apply(service.transfer(service.pack(2), 2))
    assert trainer.materialized == [["w"], ["w"]] and rollout.calls == [1, 1]
    assert torch.equal(rollout.params["w"], FULL["w"] * 2) and rollout.weight_version == 2
