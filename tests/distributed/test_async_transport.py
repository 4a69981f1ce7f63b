"""The p2p streaming transport between disjoint rank sets, over gloo on loopback."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.batches import group_batch
from tests.helpers.gloo import free_port, start_warm, stop_warm

pytestmark = pytest.mark.distributed


def _entry(fn, rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    try:
        result = fn(rank, world)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn(fn, world, tmp_path, timeout=90):
    port = free_port()
    codes = stop_warm(start_warm(_entry, [(fn, r, world, port, str(tmp_path))
                                          for r in range(world)]), timeout)
    if None in codes:
        pytest.fail("a worker hung")
    return {
        r: json.loads(Path(tmp_path, f"rank{r}.json").read_text())
        for r in range(world)
        if Path(tmp_path, f"rank{r}.json").exists()
    }


def _group(gid, first_sid, lengths, version):
    answers = [f"a{gid}"] * len(lengths)
    return group_batch(gid, lengths, first_sid, version).set_objects("answer", answers)


def _streaming(rank, world):
    from peerflow.coordinator.wire import pack_batch, unpack_batch
    from peerflow.streaming.accumulator import StepInbox
    from peerflow.streaming.transport import (
        DATA_TAG,
        Heartbeat,
        Kind,
        StreamReceiver,
        StreamSender,
    )

    trainer = world - 1
    if rank != trainer:
        sender = StreamSender(tag=DATA_TAG, timeout=20)
        beat = Heartbeat(sender=sender, targets=(trainer,), interval=0.05).start()
        for k in range(4):
            gid = rank * 100 + k
            sender.send(
                trainer,
                Kind.GROUP,
                a=k // 2,
                payload=pack_batch(_group(gid, gid * 10, [k + 1, 3], version=k // 2)),
            )
            time.sleep(0.02 * rank)
            if k % 2 == 1:
                sender.send(trainer, Kind.SEAL, a=k // 2, b=2)
        time.sleep(0.2)
        beat.stop()
        sender.send(trainer, Kind.STOP)
        sender.flush()
        return {"sent": sender.bytes_sent}
    receiver = StreamReceiver(sources=tuple(range(trainer)), tag=DATA_TAG, timeout=20).start()
    inbox = StepInbox(sources=tuple(range(trainer)))
    groups, complete_order = [], []
    while not receiver.all_stopped:
        msg = receiver.get(timeout=1.0)
        if msg is None:
            continue
        if msg.kind == Kind.GROUP:
            batch = unpack_batch(msg.payload)
            groups.append(
                [
                    int(batch.group_id[0]),
                    msg.a,
                    batch.sample_id.tolist(),
                    batch.ragged("response_ids").lengths.tolist(),
                    batch["answer"][0],
                ]
            )
            inbox.on_group(msg.a, msg.source)
        elif msg.kind == Kind.SEAL:
            inbox.on_seal(msg.a, msg.source, msg.b)
        for step in (0, 1):
            if step not in complete_order and inbox.complete(step):
                complete_order.append(step)
    receiver.join()
    return {"groups": groups, "complete": complete_order}


def test_groups_and_seals_stream_peer_to_peer(tmp_path):
    results = spawn(_streaming, 3, tmp_path)
    trainer = results[2]
    groups = sorted(trainer["groups"])
    assert [g[0] for g in groups] == [0, 1, 2, 3, 100, 101, 102, 103]
    for gid, step, sids, lengths, answer in groups:
        k = gid % 100
        assert step == k // 2 and sids == [gid * 10, gid * 10 + 1]
        assert lengths == [k + 1, 3] and answer == f"a{gid}"
    assert sorted(trainer["complete"]) == [0, 1]
    assert results[0]["sent"] > 0


def _dying_rollout(rank, world):
    from peerflow.errors import WorkerFailedError
    from peerflow.streaming.transport import DATA_TAG, Kind, StreamReceiver, StreamSender

    if rank == 1:
        StreamSender(tag=DATA_TAG, timeout=5).send(0, Kind.SEAL, a=0, b=0)
        time.sleep(0.3)
        os._exit(17)  # dies without a word
    receiver = StreamReceiver(sources=(1,), tag=DATA_TAG, timeout=20).start()
    start = time.monotonic()
    try:
        while True:
            receiver.get(timeout=0.5)
            if time.monotonic() - start > 15:
                return {"error": None}
    except WorkerFailedError as exc:
        return {"error": str(exc), "after": time.monotonic() - start}


def test_dead_rollout_rank_fails_the_trainer_fast(tmp_path):
    results = spawn(_dying_rollout, 2, tmp_path)
    error = results[0]["error"]
    assert error is not None and "rank 1 stopped sending samples" in error
    assert results[0]["after"] < 10  # well before the 20 s receive timeout
