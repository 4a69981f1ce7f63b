"""Executor and `WeightSyncService`: memory bound, dtypes, strides, versions, stats."""

from __future__ import annotations

import pytest
import torch

from peerflow.capabilities import Capabilities
from peerflow.conformance.harness import run_threaded
from peerflow.conformance.oracle import arange_globals, cut, shard_all
from peerflow.errors import ConfigError, ShardError
from peerflow.models import RankCoords, hf_layout, hf_parameters, megatron_layout, vllm_layout
from peerflow.plugins import get_plugin_manager, hookimpl
from peerflow.reshard import (
    WeightSyncService,
    make_buckets,
    make_transport,
    plan_reshard,
    sync_weights,
)
from peerflow.shard import Box, ShardSpec
from tests.helpers.tensor_engines import TensorRollout, TensorTrainer

CONFIG = dict(model_type="llama", vocab_size=130, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=4)


def test_colocated_sync_megatron_to_vllm_publishes_version_and_reports_phases():
    full = arange_globals(hf_parameters(CONFIG))
    src = megatron_layout(CONFIG)
    dst = vllm_layout(CONFIG)
    trainer = TensorTrainer(src, {s.local_name: cut(s, full) for s in src})
    rollout = TensorRollout(dst)
    seen = []

    class Recorder:
        @hookimpl
        def peerflow_after_weight_sync(self, version, role, rank, stats):
            seen.append((version, role, stats.version))

    pm = get_plugin_manager()
    pm.register(Recorder(), name="test-recorder")
    try:
        stats = sync_weights(trainer, rollout, version=7, bucket_bytes=8192)
    finally:
        pm.unregister("test-recorder")
    assert rollout.weight_version == 7
    assert sorted(seen) == [(7, "actor", 7), (7, "rollout", 7)]
    for s in dst:
        assert torch.equal(rollout.params[s.local_name], cut(s, full)), s.local_name
    assert stats.buckets >= len(rollout.calls) > 1  # a tensor streamed in slices loads once
    assert stats.bytes == sum(t.numel() * 4 for t in full.values())  # padding never moves
    assert min(stats.plan_s, stats.pack_s, stats.wire_s, stats.load_s) >= 0
    assert stats.wire_s > 0 and stats.load_s > 0
    # A run builds the service once; every later sync reuses its plan and buckets.
    service = WeightSyncService.build(trainer, rollout, bucket_bytes=8192)
    plan = service.plan
    assert service.sync(8).plan_s == 0 and rollout.weight_version == 8
    assert service.plan is plan


def test_peak_extra_memory_stays_within_two_buckets_plus_largest_tensor():
    config = dict(CONFIG, vocab_size=1000)
    full = arange_globals(hf_parameters(config))
    src = {r: megatron_layout(config, RankCoords(tp_rank=r, tp_size=2)) for r in range(2)}
    dst = {2 + r: vllm_layout(config, RankCoords(tp_rank=r, tp_size=4)) for r in range(4)}
    plan = plan_reshard(src, dst)
    largest = max(s.numel * 4 for specs in dst.values() for s in specs)
    for bucket_bytes in (2048, 16384, 1 << 20):
        got, stats = run_threaded(plan, shard_all(src, full), bucket_bytes=bucket_bytes)
        for rank, specs in dst.items():
            for s in specs:
                assert torch.equal(got[rank][s.local_name], cut(s, full))
        # Bound: two buckets, where a tensor larger than a bucket is a bucket of its own.
        for rank, st in stats.items():
            assert 0 < st.peak_extra_bytes <= 2 * max(bucket_bytes, largest), (rank, st)


def test_buckets_respect_size_and_keep_tp_shards_together():
    dst = {r: vllm_layout(CONFIG, RankCoords(tp_rank=r, tp_size=2)) for r in range(2)}
    src = {0: hf_layout(CONFIG)}
    plan = plan_reshard(src, dst)
    buckets = make_buckets(plan, 4096)
    largest = max(s.numel * 4 for specs in dst.values() for s in specs)
    for b in buckets:
        assert b.nbytes <= max(4096, largest)
        names = {n for _, n in b.targets}
        assert all(sum(1 for _, n in b.targets if n == name) in (1, 2) for name in names)
    assert sorted(t for b in buckets for t in b.loads) == sorted(  # each loaded once
        (r, s.local_name) for r, specs in dst.items() for s in specs)
    with pytest.raises(ConfigError, match="bucket_bytes=0"):
        make_buckets(plan, 0)


def test_non_contiguous_sources_and_dtype_cast():
    shape = (6, 4)
    full = torch.arange(24, dtype=torch.float32).reshape(shape)
    # The trainer holds the tensor transposed in memory (a non-contiguous view).
    storage = full.t().contiguous()
    src_tensor = storage.t()
    assert not src_tensor.is_contiguous()
    src = [ShardSpec.of_slice("w", shape, local_name="w", dtype="float32")]
    dst = [ShardSpec.of_slice("w", shape, Box(offsets=(0, 1), sizes=(6, 2)), local_name="a",
                              dtype="bfloat16"),
           ShardSpec.of_slice("w", shape, Box(offsets=(0, 0), sizes=(6, 1)), local_name="b"),
           ShardSpec.of_slice("w", shape, Box(offsets=(0, 3), sizes=(6, 1)), local_name="c",
                              dtype="float64")]
    trainer = TensorTrainer(src, {"w": src_tensor})
    rollout = TensorRollout(dst)
    sync_weights(trainer, rollout, version=1, plan=plan_reshard(src, dst), bucket_bytes=64)
    assert torch.equal(rollout.params["a"], full[:, 1:3].to(torch.bfloat16))
    assert torch.equal(rollout.params["b"], full[:, :1])
    assert torch.equal(rollout.params["c"], full[:, 3:].double())


def test_a_float32_master_copy_travels_as_the_bfloat16_its_rollout_holds():
    """The sender rounds once, as the receiver would: half the bytes, the same bits."""
    shape = (8, 16)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))  # not bf16-exact
    src = [ShardSpec.of_slice("w", shape, local_name="w", dtype="float32")]
    dst = [ShardSpec.of_slice("w", shape, local_name="w", dtype="bfloat16")]
    plan = plan_reshard(src, dst)
    assert [t.wire_dtype for t in plan.transfers] == ["bfloat16"]
    assert plan.bytes == full.numel() * 2
    wide = plan_reshard(dst, [ShardSpec.of_slice("w", shape, local_name="w", dtype="float32")])
    assert [t.wire_dtype for t in wide.transfers] == ["bfloat16"]  # widening: the source's
    rollout = TensorRollout(dst)
    sync_weights(TensorTrainer(src, {"w": full}), rollout, version=1, plan=plan,
                 bucket_bytes=64)
    assert torch.equal(rollout.params["w"], full.to(torch.bfloat16))


def test_wrong_source_shape_and_unavailable_transports_are_clear_errors():
    src = [ShardSpec.of_slice("w", (4,))]
    trainer = TensorTrainer(src, {"w": torch.zeros(5)})
    with pytest.raises(ShardError, match=r"source tensor 'w' on rank 0 has shape \(5,\)"):
        sync_weights(trainer, TensorRollout(src), version=1, plan=plan_reshard(src, src))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda_ipc.*needs a CUDA device"):
            make_transport("cuda_ipc")
    with pytest.raises(ConfigError, match="serves colocated plans only"):
        make_transport("inprocess").exchange({1: torch.zeros(1, dtype=torch.uint8)}, {}, [])


class ZeroCopyRollout(TensorRollout):
    """Offers its own tensors through `weight_buffers` (the zero-copy fast path)."""

    name = "test-zero-copy-rollout"

    def weight_buffers(self, specs):
        return [self.params[s.local_name] for s in specs]

    def load_weights(self, items):
        self.calls.append(len(items))
        for spec, tensor in items:
            if tensor.data_ptr() != self.params[spec.local_name].data_ptr():
                self.params[spec.local_name].copy_(tensor)


def test_weight_buffers_write_in_place_without_staging():
    full = arange_globals(hf_parameters(CONFIG))
    src = megatron_layout(CONFIG)
    trainer = TensorTrainer(src, {s.local_name: cut(s, full) for s in src})
    rollout = ZeroCopyRollout(vllm_layout(CONFIG))
    before = {n: t.data_ptr() for n, t in rollout.params.items()}
    stats = sync_weights(trainer, rollout, version=2, bucket_bytes=8192)
    assert stats.peak_extra_bytes == 0  # nothing staged, nothing sent across ranks
    for s in rollout.specs:
        assert rollout.params[s.local_name].data_ptr() == before[s.local_name]
        got = rollout.params[s.local_name].clone()
        for box in s.padding:
            got[box.slices()] = 0
        assert torch.equal(got, cut(s, full)), s.local_name


def test_streaming_pack_transfer_apply_snapshots_each_version_in_one_process():
    """Streaming on one rank (`inprocess`): a packed version is a snapshot, zero-copy apply."""
    full = arange_globals(hf_parameters(CONFIG))
    src = hf_layout(CONFIG)
    trainer = TensorTrainer(src, {s.local_name: cut(s, full).clone() for s in src})
    rollout = ZeroCopyRollout(vllm_layout(CONFIG))
    service = WeightSyncService.build(trainer, rollout, bucket_bytes=4096)
    assert service.transport.name == "inprocess" and len(service.buckets) > 1
    first = service.pack(1)
    for tensor in trainer.tensors.values():  # the trainer moves on while v1 is in flight
        tensor.mul_(-1)
    second = service.pack(2)
    got_first = service.transfer(first, 1)
    got_second = service.transfer(second, 2)
    pool = service.meter.current - got_first.stats.bytes - got_second.stats.bytes
    assert pool == 2 * first.stats.bytes  # two pool slots: double buffering
    stats = service.apply(got_first)
    assert rollout.weight_version == 1 and stats.bytes == got_first.stats.bytes
    for s in rollout.specs:
        got = rollout.params[s.local_name].clone()
        for box in s.padding:
            got[box.slices()] = 0
        assert torch.equal(got, cut(s, full)), s.local_name
    service.apply(got_second)
    assert rollout.weight_version == 2
    assert service.meter.current == pool  # received buffers released once applied
    s = rollout.specs[0]
    assert torch.equal(rollout.params[s.local_name][: cut(s, full).shape[0]], -cut(s, full))


class SleepyRollout(TensorRollout):
    """Declares `Capabilities.sleep` and records the calls."""

    name = "test-sleepy-rollout"
    capabilities = Capabilities(sleep=True)

    def sleep(self):
        self.calls.append("sleep")

    def wake(self, tags=None):
        self.calls.append(("wake", tuple(tags or ())))

    def load_weights(self, items):
        self.calls.append("load")


def test_colocated_time_sharing_follows_the_hybrid_engine_order():
    cls, woken = SleepyRollout, [("wake", ("weights",)), "load", ("wake", ("kv_cache",))]
    src = [ShardSpec.of_slice("w", (4, 4))]
    trainer = TensorTrainer(src, {"w": torch.ones(4, 4)})
    rollout = cls(src)
    service = WeightSyncService.build(trainer, rollout, colocated=True)
    assert service.time_share
    with service.generating():
        rollout.calls.append("generate")
    service.sync(1)
    with service.generating():
        rollout.calls.append("generate")
    assert rollout.calls == ["generate", "sleep", *woken, "generate", "sleep"]
    split = WeightSyncService.build(trainer, cls(src), colocated=False)
    assert not split.time_share
