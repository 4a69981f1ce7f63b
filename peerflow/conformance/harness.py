"""Run a `ReshardPlan` for several ranks inside one process (threads + mailboxes).

The conformance suite's CPU round trip drives the real planner and executor this way:
one thread per rank runs `run_plan`, and a `MailboxTransport` hands packed buffers between
threads, so a tp4 → tp2 × pp2 matrix runs in milliseconds without spawning processes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from peerflow.engines import WeightSyncStats
from peerflow.engines.train import yield_tensors
from peerflow.reshard import MemoryMeter, ReshardPlan, make_buckets, run_plan
from peerflow.reshard.transport import Route, WeightTransport
from peerflow.shard import ShardSpec

#: Seconds a thread waits for a peer's buffer before failing the test.
TIMEOUT_S = 60.0


@attrs.define(eq=False)
class Mailbox:
    """Queues between (source, destination) rank pairs."""

    queues: dict[tuple[int, int], queue.Queue] = attrs.field(factory=dict)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def channel(self, src: int, dst: int) -> queue.Queue:
        """Returns the queue from `src` to `dst`."""
        with self.lock:
            return self.queues.setdefault((src, dst), queue.Queue())


class MailboxTransport(WeightTransport):
    """Test transport between threads of one process (not registered as a plugin)."""

    name = "mailbox"

    def __init__(self, mailbox: Mailbox, *, rank: int) -> None:
        super().__init__(rank=rank)
        self.mailbox = mailbox

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, int],
                 routes: Sequence[Route]) -> dict[int, torch.Tensor]:
        """Posts copies of the send buffers, then waits for every expected buffer."""
        for peer, buf in sends.items():
            self.mailbox.channel(self.rank, peer).put(buf.clone())
        return {peer: self.mailbox.channel(peer, self.rank).get(timeout=TIMEOUT_S)
                for peer in recvs}


def run_threaded(
    plan: ReshardPlan,
    sources: Mapping[int, Mapping[str, torch.Tensor]],
    *,
    bucket_bytes: int = 1 << 20,
    device: str = "cpu",
    engines: Mapping[int, Any] | None = None,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, WeightSyncStats]]:
    """Executes `plan` with one thread per rank; returns destination tensors and stats.

    Args:
        plan: The plan under test.
        sources: Rank → local source tensors by local name.
        bucket_bytes: Bucket size given to `make_buckets`.
        device: Where the executor allocates buffers and destination tensors.
        engines: Destination rank → rollout engine that receives that rank's tensors
            through `load_weights` (and `weight_buffers`), like a real sync; the other
            destination ranks' tensors are returned.
    """
    engines = engines or {}
    buckets = make_buckets(plan, bucket_bytes)
    mailbox = Mailbox()
    results: dict[int, dict[str, torch.Tensor]] = {r: {} for r in plan.destinations}
    stats: dict[int, WeightSyncStats] = {}
    errors: list[BaseException] = []

    def materializer(rank: int):
        def materialize(specs: Sequence[ShardSpec]):
            return yield_tensors([sources[rank][s.local_name] for s in specs])
        return materialize

    def loader(rank: int):
        def load(items):
            for spec, tensor in items:
                results[rank][spec.local_name] = tensor.clone()
        return load

    def work(rank: int) -> None:
        engine = engines.get(rank)
        load = engine.load_weights if engine is not None else loader(rank)
        try:
            stats[rank] = run_plan(
                plan, buckets, rank=rank, transport=MailboxTransport(mailbox, rank=rank),
                materialize=materializer(rank) if rank in plan.sources else None,
                load=load if rank in plan.destinations else None,
                buffers=getattr(engine, "weight_buffers", None),
                device=device, meter=MemoryMeter(),
            )
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in plan.ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    if errors:
        raise errors[0]
    return results, stats
