"""The weight-transport contract: move one bucket's packed bytes between ranks.

A transport is a class with a `name` (what `weight_sync.transport` selects), registered
through the `peerflow_register_weight_transports` hook (built-ins live in
`peerflow.reshard.transports`). The executor hands it, per bucket, the flat `uint8`
buffers this rank sends to each peer and the byte counts it expects from each peer;
transfers a rank makes to itself never reach the transport.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from peerflow.errors import ConfigError

#: One route of a bucket: (source rank, destination rank, bytes).
Route = tuple[int, int, int]


class WeightTransport(abc.ABC):
    """Moves packed weight buckets between ranks. One instance per rank and group."""

    name: ClassVar[str]
    """Name users select the transport by."""
    requires_cuda: ClassVar[bool] = False
    """The transport needs CUDA tensors (the executor packs buckets on the GPU)."""
    keeps_buffers: ClassVar[bool] = False
    """Peers map this rank's send buffers (CUDA IPC): the service keeps its packing
    arena between syncs so the mapping stays valid and is made once."""
    timeout: float | None = None
    """Seconds one `exchange` may wait for its peers (`None`: `runtime.fault_timeout`,
    via `peerflow.distributed.comm.default_timeout`); past it, `WorkerFailedError`."""
    needs_all_sizes: ClassVar[bool] = False
    """`exchange` needs every route's byte count on every rank (a collective per sender):
    it cannot carry delta routes, whose sizes only their two ends learn
    (`peerflow.reshard.delta`)."""

    def __init__(self, *, rank: int = 0, group: Any = None, device: str = "cpu") -> None:
        """Binds the transport to this rank.

        Args:
            rank: This process's global rank.
            group: torch.distributed process group of every rank in the plan (`None`:
                the default group, or a single process).
            device: Device the buffers live on.
        """
        self.rank = rank
        self.group = group
        self.device = device

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Returns why the transport cannot run here, or `None` when it can."""
        if cls.requires_cuda and not torch.cuda.is_available():
            return f"weight transport {cls.name!r} needs a CUDA device and none is visible"
        return None

    @property
    def deadline_s(self) -> float:
        """Seconds one `exchange` may wait for its peers (`timeout`, else the run's)."""
        from peerflow.distributed.comm import default_timeout

        return default_timeout() if self.timeout is None else float(self.timeout)

    @property
    def waiting(self) -> str:
        """Who waits, as a timeout names it: this rank and the transport."""
        return f"rank {self.rank}, weight transport {self.name!r}"

    @abc.abstractmethod
    def exchange(
        self,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, int],
        routes: Sequence[Route],
    ) -> dict[int, torch.Tensor]:
        """Moves one bucket. Called on every rank of the group for every bucket.

        Args:
            sends: Peer rank → flat `uint8` buffer this rank sends it.
            recvs: Peer rank → bytes this rank receives from it.
            routes: Every cross-rank route of the bucket on every rank (the same list on
                all ranks), for transports that run collectives.

        Returns:
            Peer rank → flat `uint8` buffer received from it (one per `recvs` entry).

        Raises:
            WorkerFailedError: a peer did not answer within `deadline_s` (name it; the
                executor adds the bucket).
        """


def make_transport(name: str, *, rank: int = 0, group: Any = None,
                   device: str = "cpu") -> WeightTransport:
    """Builds the registered transport `name` for this rank.

    Raises:
        UnknownNameError: no transport of that name is registered (lists the installed).
        ConfigError: the transport cannot run here (e.g. CUDA IPC without a GPU).
    """
    from peerflow.plugins import get_plugin_manager

    cls = get_plugin_manager().registry("weight_transport").get(name)
    reason = cls.unavailable_reason()
    if reason:
        raise ConfigError(f"weight_sync.transport={name!r}: {reason}; choose another transport.")
    return cls(rank=rank, group=group, device=device)
