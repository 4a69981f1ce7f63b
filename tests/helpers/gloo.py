"""Process-group plumbing for tests that spawn gloo workers on this machine."""

from __future__ import annotations

import datetime
import os
import socket

import torch


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float | None = None) -> None:
    """Joins a loopback gloo process group (one torch thread) as `rank` of `world`."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **extra)
