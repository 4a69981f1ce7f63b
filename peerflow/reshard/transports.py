"""Built-in weight transports, registered through `peerflow_register_weight_transports`.

* `inprocess` — colocated plans only: every transfer stays inside one process, so the
  executor copies regions directly and nothing crosses a process boundary.
* `torch` — torch.distributed point-to-point (`isend`/`irecv`) on the plan's group: gloo
  on CPU, NCCL on GPU. Every rank the plan picks as a sender sends its regions.
* `shm` — same-host CPU ranks: each bucket through one `/dev/shm` segment per sender and
  one wake-up per receiver (the coordinator's `ShmRoute`, on a route of its own). The sender writes
  and returns; the receiver maps the segment. Over gloo, a push that the receiver drains
  while it generates costs the sender's gloo thread ~15 ms of CPU per 2 MB on a 2-core
  machine — CPU the trainer's step then lacks (measured 2026-11-23: "Async overhead,
  second pass" in `git log -p docs/benchmarks.md`); `auto` picks `shm` whenever every
  rank of the group shares the host.
* `torch_broadcast` — one `broadcast` per sending rank and bucket (what trainer → many
  rollout ranks weight pushes use with NCCL); every rank of the group takes part.
* `cuda_ipc` — same-host GPU (`peerflow.reshard.cuda_ipc`): each sender's buffer is
  exported and mapped once, a bucket is a small header, one device copy and an ack.
  Declares `requires_cuda`; on a CPU machine it reports itself unavailable.

Every wait has the transport's deadline (`peerflow.reshard.deadline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from peerflow.coordinator.shm import ShmRoute
from peerflow.coordinator.transport import cached_shm_route
from peerflow.distributed.comm import default_timeout, wait_all
from peerflow.errors import ConfigError
from peerflow.plugins import hookimpl
from peerflow.reshard.cuda_ipc import CudaIpcTransport
from peerflow.reshard.transport import Route, WeightTransport


class InProcessTransport(WeightTransport):
    """Colocated plans: source and destination share a process; nothing is exchanged."""

    name = "inprocess"

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, int],
                 routes: Sequence[Route]) -> dict[int, torch.Tensor]:
        """Raises when the bucket needs another process; returns nothing otherwise."""
        if sends or recvs:
            peers = sorted(set(sends) | set(recvs))
            raise ConfigError(
                f"weight transport 'inprocess' on rank {self.rank} was asked to exchange "
                f"bytes with ranks {peers}; it serves colocated plans only. Use "
                "weight_sync.transport='torch' when trainer and rollout ranks differ."
            )
        return {}


class TorchP2PTransport(WeightTransport):
    """torch.distributed `isend`/`irecv` (gloo on CPU, NCCL on GPU)."""

    name = "torch"

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, int],
                 routes: Sequence[Route]) -> dict[int, torch.Tensor]:
        """Posts every send and receive of this rank, then waits for all of them."""
        out = {peer: torch.empty(n, dtype=torch.uint8, device=self.device)
               for peer, n in recvs.items()}
        works = []
        # Post in rank order on both sides so gloo pairs match without deadlock.
        for peer in sorted(set(sends) | set(recvs)):
            if peer in sends:
                works.append((peer, "send to",
                              dist.isend(sends[peer], dst=peer, group=self.group)))
            if peer in out:
                works.append((peer, "receive from",
                              dist.irecv(out[peer], src=peer, group=self.group)))
        wait_all(works, self.waiting, self.deadline_s)
        return out


class SharedMemoryTransport(WeightTransport):
    """Same-host CPU ranks: every bucket through `/dev/shm` (`peerflow.coordinator.shm`)."""

    name = "shm"

    def route(self) -> ShmRoute | str:
        """The group's shared-memory route, or why its ranks cannot share memory.

        The coordinator's route cache holds it (namespace `weights:`, so its call counter
        is the weight sync's own) and releases it with the world group. The first call
        waits for every rank of the group to publish its host (every rank calls
        `exchange` for every bucket, so every rank gets here).
        """
        if torch.device(self.device).type != "cpu":
            return f"its buffers live on {self.device!r}, not in host memory"
        ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        return cached_shm_route(ranks, default_timeout(), namespace="weights:")

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, int],
                 routes: Sequence[Route]) -> dict[int, torch.Tensor]:
        """Writes this rank's sends as one segment, then maps each sender's segment."""
        route = self.route()
        if isinstance(route, str):
            raise ConfigError(f"weight_sync.transport='shm' on rank {self.rank}: {route}; "
                              "use weight_sync.transport='torch' (or 'auto').")
        received, _ = route.begin_call().exchange(
            ((peer, buf, buf.numel()) for peer, buf in sends.items()), dict(recvs), tag=0,
            what=f"weight bucket on rank {self.rank}", timeout=self.deadline_s)
        return received


class TorchBroadcastTransport(WeightTransport):
    """One `broadcast` per sending rank: every rank of the group receives the bucket."""

    name = "torch_broadcast"
    needs_all_sizes = True

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, int],
                 routes: Sequence[Route]) -> dict[int, torch.Tensor]:
        """Broadcasts each sender's buffers (destinations in rank order) to the group."""
        out: dict[int, torch.Tensor] = {}
        for src in sorted({s for s, _, _ in routes}):
            mine = sorted((d, n) for s, d, n in routes if s == src)
            total = sum(n for _, n in mine)
            if src == self.rank:
                buf = torch.cat([sends[d] for d, _ in mine]) if len(mine) > 1 else sends[mine[0][0]]
            else:
                buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            work = dist.broadcast(buf, src=src, group=self.group, async_op=True)
            wait_all([(src, "receive the broadcast of", work)], self.waiting, self.deadline_s)
            offset = 0
            for dst, n in mine:
                if dst == self.rank:
                    out[src] = buf[offset:offset + n]
                offset += n
        return out


BUILTIN_TRANSPORTS = (InProcessTransport, TorchP2PTransport, SharedMemoryTransport,
                      TorchBroadcastTransport, CudaIpcTransport)


@hookimpl
def peerflow_register_weight_transports(register):
    """Registers the built-in transports."""
    for cls in BUILTIN_TRANSPORTS:
        register(cls)
