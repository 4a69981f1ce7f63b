"""Asynchronous weight push: fsdp trainer rank → hf rollout rank, hooks on both sides."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch

from peerflow.plugins.hookspecs import hookimpl
from tests.helpers.gloo import free_port, start_warm, stop_warm

pytestmark = pytest.mark.distributed


class _Hooks:
    def __init__(self):
        self.calls = []

    @hookimpl
    def peerflow_before_weight_sync(self, version, role, rank):
        self.calls.append(["before", version, role, rank])

    @hookimpl
    def peerflow_after_weight_sync(self, version, role, rank, stats):
        self.calls.append(["after", version, role, rank, int(stats.bytes)])


def _worker(rank, port, model_path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.layout import ParallelLayout
    from peerflow.plugins import get_plugin_manager
    from peerflow.reshard import WeightSyncService
    from peerflow.streaming.transport import (
        WEIGHT_TAG,
        Kind,
        StreamReceiver,
        StreamSender,
    )
    from peerflow.streaming.weight_push import WeightPusher, WeightReceiver

    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    trainer_group = dist.new_group([1])
    weight_group = dist.new_group([0, 1])  # the transport's own group (background threads)
    hooks = _Hooks()
    get_plugin_manager().register(hooks, "test-weight-hooks")
    result = {}
    if rank == 0:
        from peerflow.adapters.hf.engine import HFRolloutEngine

        rollout = HFRolloutEngine(EngineContext(model_path=model_path,
                                                layout=ParallelLayout(ranks=(0,)), rank=0))
        service = WeightSyncService.build(None, rollout, bucket_bytes=4096, group=weight_group)
        # wipe the rollout's weights so only the push can restore them
        rollout.begin_weight_update(0)
        rollout.load_weights([(s, torch.zeros(s.local_shape)) for s in rollout.weight_targets()])
        rollout.finish_weight_update()
        receiver = WeightReceiver(service=service, receiver=StreamReceiver(
            sources=(1,), tag=WEIGHT_TAG, timeout=60, what="weights").start()).start()
        version = None
        deadline = time.time() + 60
        while version != 3 and time.time() < deadline:  # let all three versions land
            version = receiver.poll(timeout=0.5) or version
        receiver.apply(rollout, version)
        result["version"] = rollout.weight_version
        result["skipped"] = receiver.skipped
        result["weights"] = {n: p.detach().clone().tolist()
                             for n, p in list(rollout._params.items())[:3]}
        while not receiver.stopped:
            receiver.poll(timeout=0.5)
        result["buckets"] = len(service.buckets)
    else:
        from peerflow.adapters.fsdp.engine import FSDPTrainEngine

        trainer = FSDPTrainEngine(
            EngineContext(model_path=model_path, layout=ParallelLayout(ranks=(1,)), rank=1,
                          process_group=trainer_group),
            FSDPTrainEngine.options_class(), OptimSettings())
        service = WeightSyncService.build(trainer, None, bucket_bytes=4096, group=weight_group)
        sender = StreamSender(tag=WEIGHT_TAG, timeout=60)
        pusher = WeightPusher(service=service, sender=sender)
        for version in (1, 2, 3):
            pusher.push(trainer, version)
        specs = list(trainer.weight_sources())
        with trainer.materialize(specs) as tensors:
            result["weights"] = {s.local_name: t.detach().clone().tolist()
                                 for s, t in zip(specs, tensors)}
        pusher.drain()
        sender.send(0, Kind.STOP)
        sender.flush()
    result["hooks"] = hooks.calls
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_push_is_bucketed_double_buffered_and_fires_hooks(tmp_path):
    from peerflow.contrib.tasks.generated import ReverseDigitsTask

    model_path = ReverseDigitsTask.build_model(
        {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
         "num_kv_heads": 2})
    port = free_port()
    procs = start_warm(_worker, [(r, port, model_path, str(tmp_path)) for r in range(2)])
    assert stop_warm(procs, 180) == [0, 0]
    rollout = json.loads((tmp_path / "rank0.json").read_text())
    trainer = json.loads((tmp_path / "rank1.json").read_text())
    assert rollout["version"] == 3 and rollout["skipped"] == 2  # 1 and 2 were overtaken
    assert rollout["buckets"] > 1
    assert len(rollout["weights"]) == 3 and set(rollout["weights"]) <= set(trainer["weights"])
    for name, values in rollout["weights"].items():
        assert torch.equal(torch.tensor(values), torch.tensor(trainer["weights"][name])), name
        assert torch.tensor(values).abs().sum() > 0  # the wiped weights came back
    assert [c[:3] for c in trainer["hooks"]] == [
        [when, v, "actor"] for v in (1, 2, 3) for when in ("before", "after")]
    assert [c[:3] for c in rollout["hooks"]] == [["before", 3, "rollout"], ["after", 3, "rollout"]]
    assert rollout["hooks"][1][4] > 0  # bytes received
