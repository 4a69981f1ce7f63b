"""The one place PeerFlow creates process groups.

Every group gets the backend string of `peerflow.distributed.devices.group_backend`:
host tensors travel over gloo and device tensors over the device's backend, so a caller
never picks a group by what it sends. `torch.distributed.new_group` is collective: every
rank of the world calls `new_group` with the same arguments, in the same order.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist


def world_backend() -> str:
    """The default group's backend string (`gloo`, `cpu:gloo,cuda:nccl`, …)."""
    return str(dist.get_backend())


def new_group(ranks: Sequence[int] | None = None, *, timeout: float | None = None) -> Any:
    """A process group of `ranks` (all ranks: `None`) with the world's backends.

    Call on every rank of the world, in the same order (group creation is collective).

    Args:
        ranks: Global ranks of the group; `None` for a second group over every rank (a
            channel of its own, e.g. for transfers on a background thread).
        timeout: Seconds each collective of the group may take; the world's when `None`.
    """
    kwargs: dict[str, Any] = {"backend": world_backend()}
    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    return dist.new_group(None if ranks is None else list(ranks), **kwargs)
