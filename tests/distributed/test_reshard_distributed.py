"""`sync_weights` across two gloo processes: split and colocated, p2p and broadcast."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed

CONFIG = dict(model_type="qwen3", vocab_size=130, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=4)


def _check(rollout, full, version):
    from peerflow.conformance.oracle import cut

    bad = [s.local_name for s in rollout.specs
           if not torch.equal(rollout.params[s.local_name], cut(s, full))]
    assert not bad, f"wrong tensors {bad}"
    assert rollout.weight_version == version


def _worker(rank: int, world: int) -> dict:
    from peerflow.conformance.oracle import arange_globals, cut
    from peerflow.models import RankCoords, hf_layout, hf_parameters, megatron_layout, vllm_layout
    from peerflow.reshard import plan_weight_sync, sync_weights
    from tests.helpers.tensor_engines import TensorRollout as Rollout
    from tests.helpers.tensor_engines import TensorTrainer as Trainer

    full = arange_globals(hf_parameters(CONFIG))
    out = {}
    # Split: the trainer (Megatron tp1 layout) on rank 0, the rollout (vLLM) on rank 1.
    trainer = rollout = None
    if rank == 0:
        specs = megatron_layout(CONFIG)
        trainer = Trainer(specs, {s.local_name: cut(s, full) for s in specs})
    else:
        rollout = Rollout(vllm_layout(CONFIG))
    stats = sync_weights(trainer, rollout, version=3, bucket_bytes=4096)
    if rollout is not None:
        _check(rollout, full, 3)
    out["split"] = (stats.bytes, stats.buckets, stats.wire_s)
    # Colocated: every rank holds an FSDP shard and a vLLM tp shard.
    specs = hf_layout(CONFIG, shard_rank=rank, shard_size=world)
    trainer = Trainer(specs, {s.local_name: cut(s, full) for s in specs})
    for transport in ("torch", "torch_broadcast"):
        rollout = Rollout(vllm_layout(CONFIG, RankCoords(tp_rank=rank, tp_size=world)))
        plan = plan_weight_sync(trainer, rollout)
        stats = sync_weights(trainer, rollout, plan=plan, version=4, bucket_bytes=2048,
                             transport=transport)
        _check(rollout, full, 4)
        out[transport] = (stats.bytes, stats.buckets, stats.peak_extra_bytes)
    return out


def test_sync_weights_split_and_colocated_over_gloo():
    by_rank = run_gloo(_worker, 2)
    # Split: rank 0 only sends, rank 1 only receives; the same bytes on both sides.
    assert by_rank[0]["split"][0] == by_rank[1]["split"][0] > 0
    for transport in ("torch", "torch_broadcast"):
        assert all(by_rank[r][transport][0] > 0 for r in range(2))
        assert all(by_rank[r][transport][2] > 0 for r in range(2))


def _both_modes_worker(rank: int, world: int) -> dict:
    """Every registered transport: lockstep `sync` and streaming push → apply."""
    import time

    import torch.distributed as dist

    from peerflow.conformance.oracle import arange_globals, cut
    from peerflow.models import hf_layout, hf_parameters, vllm_layout
    from peerflow.plugins import get_plugin_manager
    from peerflow.reshard import WeightSyncService
    from peerflow.streaming.transport import WEIGHT_TAG, Kind, StreamReceiver, StreamSender
    from peerflow.streaming.weight_push import WeightPusher, WeightReceiver
    from tests.helpers.tensor_engines import TensorRollout as Rollout
    from tests.helpers.tensor_engines import TensorTrainer as Trainer

    class ZeroCopy(Rollout):
        def weight_buffers(self, specs):
            return [self.params[s.local_name] for s in specs]

    full = arange_globals(hf_parameters(CONFIG))
    alone = [dist.new_group([r]) for r in range(world)][rank]
    registry = get_plugin_manager().registry("weight_transport")
    out = {}
    for name in sorted(registry.names()):
        cls = registry.get(name)
        if cls.unavailable_reason():
            out[name] = cls.unavailable_reason()
            continue
        group = dist.new_group(list(range(world)))  # the transport's own group
        specs = hf_layout(CONFIG)
        trainer = Trainer(specs, {s.local_name: cut(s, full).clone() for s in specs})
        if name == "inprocess":  # colocated plans only: each rank syncs into itself
            rollout = ZeroCopy(vllm_layout(CONFIG))
            service = WeightSyncService.build(trainer, rollout, transport=name, group=alone,
                                              bucket_bytes=2048)
            service.sync(1)
            _check(rollout, full, 1)
            service.apply(service.transfer(service.pack(2), 2))
            _check(rollout, full, 2)
            out[name] = "both"
            continue
        rollout = ZeroCopy(vllm_layout(CONFIG)) if rank == 1 else None
        trainer = trainer if rank == 0 else None
        service = WeightSyncService.build(trainer, rollout, transport=name, group=group,
                                          bucket_bytes=2048)
        service.sync(1)
        if rollout is not None:
            _check(rollout, full, 1)
            receiver = WeightReceiver(service=service, receiver=StreamReceiver(
                sources=(0,), tag=WEIGHT_TAG, timeout=60, what="weights").start()).start()
            deadline = time.time() + 120
            while receiver.poll(timeout=0.5) != 3 and time.time() < deadline:
                pass
            receiver.apply(rollout, 3)
            _check(rollout, {k: v * 3 for k, v in full.items()}, 3)
            while not receiver.stopped:
                receiver.poll(timeout=0.5)
        else:
            sender = StreamSender(tag=WEIGHT_TAG, timeout=60)
            pusher = WeightPusher(service=service, sender=sender)
            for version in (2, 3):
                for s in specs:  # the trainer's weights move on between pushes
                    trainer.tensors[s.local_name].copy_(cut(s, full) * version)
                pusher.push(trainer, version)
            pusher.drain()
            sender.send(1, Kind.STOP)
            sender.flush()
        out[name] = "both"
    return out


def test_every_registered_transport_runs_lockstep_and_streaming():
    got = run_gloo(_both_modes_worker, 2)
    from peerflow.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("weight_transport")
    for out in got.values():
        assert set(out) == set(registry.names())
        for name in registry.names():
            reason = registry.get(name).unavailable_reason()
            assert out[name] == (reason or "both"), name
