"""Weight sync over gloo: every trainer rank sends its shard, and a silent peer fails fast."""

from __future__ import annotations

import pytest

from tests.helpers.gloo import run_gloo

pytestmark = pytest.mark.distributed

CONFIG = dict(model_type="qwen3", vocab_size=130, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=4)
#: The deadline of the silent-receiver test (the sync must end well within 3x of it).
DEADLINE_S = 2.0


def _dp2_tp2_worker(rank: int, world: int) -> dict:
    """Ranks 0-1: trainer dp = 2 (whole replicated tensors); ranks 2-3: rollout tp = 2."""
    import torch

    from peerflow.conformance.oracle import arange_globals, cut
    from peerflow.models import RankCoords, hf_layout, hf_parameters, vllm_layout
    from peerflow.reshard import WeightSyncService
    from tests.helpers.tensor_engines import TensorRollout, TensorTrainer

    full = arange_globals(hf_parameters(CONFIG))
    trainer = rollout = None
    if rank < 2:
        specs = hf_layout(CONFIG, RankCoords(dp_rank=rank))
        trainer = TensorTrainer(specs, {s.local_name: cut(s, full) for s in specs})
    else:
        rollout = TensorRollout(vllm_layout(CONFIG, RankCoords(tp_rank=rank - 2, tp_size=2)))
    service = WeightSyncService.build(trainer, rollout, transport="torch", bucket_bytes=8192)
    stats = service.sync(1)
    if rollout is not None:
        bad = [s.local_name for s in rollout.specs
               if not torch.equal(rollout.params[s.local_name], cut(s, full))]
        assert not bad, bad
    return {"sent": stats.wire_bytes, "share": stats.sender_share, "senders": stats.senders,
            "bytes": stats.bytes, "pause_s": stats.pause_s}


@pytest.mark.slow  # 4 processes (~30 s on 2 busy cores); tests/unit/test_reshard_senders.py
def test_dp2_to_tp2_every_trainer_rank_sends_and_no_rank_gets_the_model():  # runs it threaded
    got = run_gloo(_dp2_tp2_worker, 4)
    model = got[0]["sent"] + got[1]["sent"]  # split placement: every byte crosses
    assert got[0]["sent"] > 0 and got[1]["sent"] > 0
    assert got[0]["senders"] == 2 and got[0]["share"] <= 0.6
    assert max(got[0]["sent"], got[1]["sent"]) <= 0.6 * model
    assert all(got[r]["bytes"] < model for r in (2, 3))  # each tp rank: its shard only
    assert got[2]["pause_s"] > 0 and got[0]["pause_s"] == 0


def _silent_receiver_worker(rank: int, world: int) -> dict:
    """Rank 0 trains and sends; rank 1 (the rollout) never joins the sync."""
    import time

    from peerflow.conformance.oracle import arange_globals, cut
    from peerflow.errors import WorkerFailedError
    from peerflow.models import hf_layout, hf_parameters, vllm_layout
    from peerflow.reshard import make_buckets, plan_reshard, run_plan
    from peerflow.reshard.transports import TorchP2PTransport
    from tests.helpers.tensor_engines import TensorTrainer

    config = dict(CONFIG, hidden_size=256, intermediate_size=1024)  # ~8 MB: no socket buffers it
    full = arange_globals(hf_parameters(config))
    plan = plan_reshard({0: hf_layout(config)}, {1: vllm_layout(config)})
    if rank == 1:
        time.sleep(1.5 * DEADLINE_S)  # alive past the deadline, but not answering
        return {}
    trainer = TensorTrainer(plan.sources[0], {s.local_name: cut(s, full)
                                              for s in plan.sources[0]})
    transport = TorchP2PTransport(rank=0)
    transport.timeout = DEADLINE_S
    start = time.monotonic()
    try:
        run_plan(plan, make_buckets(plan, 1 << 30), rank=0, transport=transport,
                 materialize=trainer.materialize, load=None)
    except WorkerFailedError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_a_receiver_that_stops_answering_fails_the_sync_within_its_deadline():
    got = run_gloo(_silent_receiver_worker, 2, timeout_s=30)[0]
    assert got["error"] is not None, f"the sync returned after {got['seconds']:.1f} s"
    assert got["seconds"] < 3 * DEADLINE_S
    for part in ("bucket 0", "'torch'", "rank(s) [1]", "rank 0"):
        assert part in got["error"], (part, got["error"])


def _ipc_protocol_worker(rank: int, world: int, colocated: bool = False) -> dict:
    """`cuda_ipc`'s protocol on host memory: exports once, slots, headers, acks.

    Split: rank 0 sends to rank 1. Colocated: FSDP shards to vLLM tp = 2 on both ranks,
    so each rank exports to and maps from the other in the same bucket.
    """
    import contextlib

    import torch
    import torch.multiprocessing

    from peerflow.conformance.oracle import arange_globals, cut
    from peerflow.models import RankCoords, hf_layout, hf_parameters, vllm_layout
    from peerflow.reshard import make_buckets, plan_reshard, run_plan
    from peerflow.reshard.arena import Arena, MemoryMeter
    from peerflow.reshard.cuda_ipc import CudaIpcTransport

    torch.multiprocessing.set_sharing_strategy("file_system")  # storages by name, no fds
    full = arange_globals(hf_parameters(CONFIG))
    if colocated:
        plan = plan_reshard(
            {r: hf_layout(CONFIG, shard_rank=r, shard_size=2) for r in range(2)},
            {r: vllm_layout(CONFIG, RankCoords(tp_rank=r, tp_size=2)) for r in range(2)})
    else:
        plan = plan_reshard({0: hf_layout(CONFIG)}, {1: vllm_layout(CONFIG)})
    buckets = make_buckets(plan, 4096)
    transport = CudaIpcTransport(rank=rank)
    transport.timeout = 60
    arena, exports, got = Arena(meter=MemoryMeter()), [], {}
    # Host memory shares by copying unless it already lives in shared memory (device
    # memory is mapped as it is): allocate the kept arena there.
    arena.reserve_total(2 * plan.bytes)
    arena.buffer.share_memory_()
    sources = {s.local_name: cut(s, full).clone() for s in plan.sources.get(rank, ())}
    targets = {s.local_name: torch.zeros(s.local_shape) for s in plan.destinations.get(rank, ())}
    mine = plan.destinations.get(rank, ())
    for version in (1, 2, 3):
        for name in sources:
            sources[name].mul_(version)  # new weights every sync
        full = {k: v * version for k, v in full.items()}
        run_plan(plan, buckets, rank=rank, transport=transport, arena=arena,
                 materialize=(lambda ss: contextlib.nullcontext(
                     [sources[s.local_name] for s in ss])) if sources else None,
                 load=(lambda items: None) if mine else None,
                 buffers=(lambda ss: [targets[s.local_name] for s in ss]) if mine else None)
        exports.append(sum(len(v) for v in transport._exported.values()))
        if mine:
            got[version] = all(torch.equal(targets[s.local_name], cut(s, full)) for s in mine)
    return {"exports": exports, "correct": got, "buckets": len(buckets)}


def _ipc_colocated_worker(rank: int, world: int) -> dict:
    return _ipc_protocol_worker(rank, world, colocated=True)


@pytest.mark.parametrize("worker", [_ipc_protocol_worker, _ipc_colocated_worker],
                         ids=["split", "colocated"])
def test_cuda_ipc_protocol_maps_each_buffer_once_on_host_memory(worker):
    got = run_gloo(worker, 2, timeout_s=60)
    receivers = [r for r in got if got[r]["correct"]]
    assert receivers and all(got[r]["correct"] == {1: True, 2: True, 3: True}
                             for r in receivers)
    assert got[0]["buckets"] > 3
    assert all(got[r]["exports"][-1] <= 2 for r in got)  # not once per bucket
