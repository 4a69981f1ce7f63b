"""The distributed host/device sites, checked on two ranks of the emulated accelerator.

Each rank starts the world with `init_distributed` (the device contract's backends:
`cpu:gloo,emu:emunccl`, the emulated `cpu:gloo,cuda:nccl`) and runs every site, recording
its traceback instead of stopping, so one spawn reports them all.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

#: Site name → what it checks (the test ids of `on_device_sites.test_distributed_site`).
SITES = ("barrier", "whiten_over_role_group", "all_gather_ragged_nccl_only",
         "coordinator_exchange")
WORLD = 2


def _barrier(device: torch.device) -> None:
    """H200 run1: `barrier` all-reduced a host tensor over the NCCL-only default group."""
    from peerflow.distributed import barrier

    barrier()
    total = torch.ones(1, device=device)
    dist.all_reduce(total)  # device tensors travel on the same default group
    assert total.device == device and total.item() == WORLD


def _whiten(device: torch.device) -> None:
    """`whiten` all-reduces its statistics over the estimator's role group."""
    from peerflow.algorithms.ragged_ops import whiten
    from peerflow.distributed.groups import new_group

    group = new_group(range(WORLD))
    mine = torch.arange(4.0) + 4 * dist.get_rank()
    every = torch.arange(4.0 * WORLD)
    want = (mine - every.mean()) / (every.std() + 1e-8)
    for values in (mine, mine.to(device)):  # host statistics (gloo), device ones (NCCL)
        got = whiten(values, group)
        assert got.device == values.device
        torch.testing.assert_close(got.cpu(), want)


def _all_gather_ragged(device: torch.device) -> None:
    """`all_gather_ragged` put its counts on the host; an NCCL-only group refuses them."""
    from peerflow.distributed import all_gather_ragged
    from peerflow.testing.emulated_device import BACKEND_NAME

    nccl_only = dist.new_group(list(range(WORLD)), backend=BACKEND_NAME)
    rank = dist.get_rank()
    rows = torch.full((rank + 1, 2), float(rank), device=device)
    got = all_gather_ragged(rows, nccl_only)
    assert [tuple(g.shape) for g in got] == [(1, 2), (2, 2)]
    assert all(g.device == device for g in got)


def _exchange(device: torch.device) -> None:
    """The coordinator sends host bytes with no group: the default group's gloo carries them."""
    from peerflow.coordinator.exchange import exchange, frame

    rank = dist.get_rank()
    peer = 1 - rank
    message = frame(torch.arange(10, dtype=torch.int64) + rank)
    received, _ = exchange([(peer, message, message.numel())], {peer: message.numel()},
                           tag=11, what="test exchange", timeout=30)
    body = received[peer][8:].view(torch.int64)
    assert body.tolist() == list(range(peer, peer + 10))


CHECKS: dict[str, Callable[[torch.device], None]] = {
    "barrier": _barrier, "whiten_over_role_group": _whiten,
    "all_gather_ragged_nccl_only": _all_gather_ragged, "coordinator_exchange": _exchange}


def _rank(rank: int, port: int, results: object) -> None:
    from peerflow.distributed.init import init_distributed, shutdown_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0")
    outcome: dict[str, str | None] = {}
    try:
        ctx = init_distributed(timeout=60, rank=rank, world_size=WORLD, monitor=False,
                               init_method=f"tcp://127.0.0.1:{port}")
        for name in SITES:
            try:
                assert ctx.device.type != "cpu", f"rank {rank} computes on {ctx.device}"
                CHECKS[name](ctx.device)
                outcome[name] = None
            except Exception:
                outcome[name] = traceback.format_exc()
        shutdown_distributed()
    except Exception:
        outcome = {name: traceback.format_exc() for name in SITES}
    results.put((rank, outcome))


def run_sites() -> dict[str, str | None]:
    """Runs every site on two emulated ranks; site → `None`, or the ranks' tracebacks."""
    from peerflow.distributed.init import free_port
    from peerflow.launch.warm import warm_context
    from tests.helpers.gloo import warm_processes

    results = warm_context().Queue()
    port = free_port()
    with warm_processes(_rank, [(rank, port, results) for rank in range(WORLD)]) as procs:
        try:
            got = dict(results.get(timeout=240) for _ in procs)
        except queue.Empty:
            got = {}
    merged: dict[str, str | None] = {}
    for name in SITES:
        errors = [f"rank {r}: {got[r][name]}" for r in sorted(got) if got[r][name]]
        if len(got) < WORLD:
            errors.append(f"only ranks {sorted(got)} reported within 240 s")
        merged[name] = "\n".join(errors) or None
    return merged
