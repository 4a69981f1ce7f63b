"""Worker processes for tests: warm forks, gloo groups on this machine, torchrun-like ranks."""

from __future__ import annotations

import datetime
import os
import queue
import runpy
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from peerflow.distributed.init import free_port
from peerflow.launch.warm import warm_context, warm_process


def init_gloo(rank: int, world: int, port: int, timeout_s: float | None = None) -> None:
    """Joins a loopback gloo process group (one torch thread) as `rank` of `world`."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **extra)


def start_warm(target: Callable[..., Any], arg_tuples: Iterable[tuple]) -> list:
    """Starts one warm-forked process (`peerflow.launch.warm`) running `target(*args)` per
    tuple of `arg_tuples`, and returns them in that order."""
    procs = [warm_process(target, tuple(args)) for args in arg_tuples]
    for p in procs:
        p.start()
    return procs


def stop_warm(procs: list, timeout_s: float = 30) -> list[int | None]:
    """Waits up to `timeout_s` (for all of them together) for `procs` to exit; kills the rest.

    Returns:
        Each process's exit code, in order; `None` for one that was still running at the
        deadline (it hung, and was killed).
    """
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


@contextmanager
def warm_processes(target: Callable[..., Any], arg_tuples: Iterable[tuple], *,
                   timeout_s: float = 30) -> Iterator[list]:
    """`start_warm`'s processes for the block; leaving it stops them (`stop_warm`), so a
    failing test leaves none behind."""
    procs = start_warm(target, arg_tuples)
    try:
        yield procs
    finally:
        stop_warm(procs, timeout_s)


def run_gloo(body: Callable[[int, int], Any], world: int, *, timeout_s: float = 240) -> dict:
    """Runs `body(rank, world)` in `world` new processes joined in one gloo group.

    The processes fork from the warm fork server (`peerflow.launch.warm`), which this
    process starts once, so each starts with torch imported.

    `body` must be a module-level function and return plain data (a shared tensor's file
    descriptor is gone once its process exits). Collectives time out after `timeout_s`.

    Returns:
        Rank → what `body` returned there; fails the test with every worker's traceback.
    """
    results = warm_context().Queue()
    port = free_port()
    wait_s = timeout_s + 160
    with warm_processes(_run_rank, [(body, rank, world, port, timeout_s, results)
                                    for rank in range(world)]) as procs:
        try:
            got = [results.get(timeout=wait_s) for _ in procs]
        except queue.Empty:
            pytest.fail(f"a worker neither finished nor reported an error within {wait_s} s")
    errors = [err for _, _, err in got if err]
    assert not errors, "\n".join(errors)
    return {rank: out for rank, out, _ in got}


def _run_rank(body: Callable[[int, int], Any], rank: int, world: int, port: int,
              timeout_s: float, results: Any) -> None:
    import torch.distributed as dist

    init_gloo(rank, world, port, timeout_s=timeout_s)
    try:
        results.put((rank, body(rank, world), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_script(script: Path | str, *args: str, nprocs: int = 2, timeout: float = 420) -> None:
    """Runs `script ARGS` as `__main__` on `nprocs` ranks, started as torchrun would.

    Each rank is a warm process (`warm_process`) with torchrun's environment for an
    `env://` rendezvous (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, …), one torch
    thread, and its output in a log of its own. Fails naming every rank that did not
    exit 0, with the end of its log.
    """
    logs = Path(tempfile.mkdtemp(prefix="peerflow-test-ranks-"))
    port = free_port()
    procs = start_warm(_script_rank, [(str(script), args, rank, nprocs, port, str(logs))
                                      for rank in range(nprocs)])
    failed = []
    for rank, code in enumerate(stop_warm(procs, timeout)):
        if code != 0:
            log = (logs / f"rank{rank}.log").read_text()[-6000:]
            failed.append(f"rank {rank} {'hung past the timeout' if code is None else 'exited'} "
                          f"({procs[rank].exitcode}):\n{log}")
    assert not failed, "\n".join(failed)
    shutil.rmtree(logs, ignore_errors=True)


def _script_rank(script: str, args: tuple[str, ...], rank: int, world: int, port: int,
                 logs: str) -> None:
    log = os.open(os.path.join(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # as `python script` has it
    runpy.run_path(script, run_name="__main__")
