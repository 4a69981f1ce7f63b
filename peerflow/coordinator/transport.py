"""Which transport a route's exchanges use: shared memory on one host, gloo otherwise.

`open_channel(participants, transport)` returns the channel of one `redistribute` call;
both modes (p2p and the centralized baseline) run their rounds over it, so comparing
them compares designs, not transports:

* `gloo`: `exchange.GlooChannel`, one gloo message per pair (any set of hosts);
* `shm`: `shm.ShmRoute`, segments under `/dev/shm` and one wake-up per sender,
  receiver and round (`coordinator.inbox`); every rank of the route must share this
  host's `/dev/shm`;
* `auto` (the default): `shm` when they do, else `gloo`.

Whether they do is decided once per rank set: every rank publishes its host identity
(boot id, host name and the device and inode of `/dev/shm`, so containers with separate
`/dev/shm` mounts differ), its process id and its usable cores in the default c10d store
at its first call, and the ranks of a route read each other's — the same values, so the
same decision on every rank (and the same `ShmRoute.cores`).

The pid names the rank's `/dev/shm` files and FIFOs, so the records are signed with the
run's secret (`peerflow.distributed.signing`) and checked when read
(`read_host_records`): a record without the run's signature, or one on this host whose
pid is not a live process of another rank, is refused with `RecordRefusedError`.
"""

from __future__ import annotations

import hashlib
import os
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from peerflow.coordinator.exchange import ExchangeChannel, GlooChannel
from peerflow.coordinator.shm import SHM_DIR, ShmRoute, this_process_inbox
from peerflow.distributed.comm import store_wait
from peerflow.distributed.procs import process_gone
from peerflow.distributed.signing import RecordRefusedError, signed

#: Accepted values of `redistribute(transport=…)` and `runtime.coordinator_transport`.
TRANSPORTS = ("auto", "gloo", "shm")

_GLOO = GlooChannel()
# Every shared-memory route of this process (the coordinator's and the weight sync's):
# world process group → (namespace, rank set) → route, or why its ranks share no memory.
# Keyed weakly, so that neither holds a destroyed group (and its gloo threads) alive until
# interpreter exit: C++ threads torn down during finalization abort the process
# ("terminate called without an active exception"). A destroyed group's routes are
# released with it (their files removed).
_ROUTES: weakref.WeakKeyDictionary[Any, dict[tuple[str, tuple[int, ...]], ShmRoute | str]] = (
    weakref.WeakKeyDictionary())
_PUBLISHED: weakref.WeakSet[Any] = weakref.WeakSet()


def host_identity() -> str:
    """This process's shared-memory domain ('' when `/dev/shm` is not a writable dir)."""
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    shm = os.stat(SHM_DIR)
    return f"{socket.gethostname()}/{boot}/{shm.st_dev}:{shm.st_ino}"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; `os.cpu_count()` without one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this platform
        return os.cpu_count() or 1


def shm_route(participants: tuple[int, ...], timeout: float, *, namespace: str = ""
              ) -> ShmRoute | str:
    """A new `ShmRoute` of the rank set, or why its ranks cannot share memory.

    Every rank of `participants` calls it (it waits for their host identities).
    `namespace` separates routes of the same rank set that run independently (the
    weight sync's from the coordinator's): each route keeps its own call counter.
    """
    store = signed(dist.distributed_c10d._get_default_store())
    rank = dist.get_rank()
    world = dist.group.WORLD
    inbox = this_process_inbox() if host_identity() else None  # before peers learn our pid
    if world not in _PUBLISHED:
        store.set(f"peerflow/host/{rank}",
                  f"{host_identity()}|{os.getpid()}|{usable_cores()}")
        _PUBLISHED.add(world)
    keys = {f"peerflow/host/{r}": r for r in participants}
    store_wait(store, keys, "redistribute: host detection", timeout)
    hosts, pids, cores = read_host_records(store, participants, dist.get_world_size())
    if "" in hosts:
        return f"ranks {hosts['']} have no writable {SHM_DIR}"
    if len(hosts) > 1:
        return f"the route's ranks are on {len(hosts)} hosts ({sorted(hosts.values())})"
    route_key = hashlib.blake2s((namespace + ",".join(map(str, participants))).encode(),
                                digest_size=6).hexdigest()
    return ShmRoute(inbox=inbox, rank=rank, route_key=route_key, pids=pids,
                    cores=min(cores))


def _host_record(rank: int, value: bytes, world_size: int) -> tuple[str, int, int]:
    """`(identity, pid, cores)` of `rank`'s host record, checked (see `read_host_records`)."""
    where = f"redistribute: the host record of rank {rank} (peerflow/host/{rank})"
    if not 0 <= rank < world_size:
        raise RecordRefusedError(f"{where}: rank {rank} is outside the world of {world_size}")
    try:
        identity, pid_text, cores_text = value.decode().rsplit("|", 2)
        pid, usable = int(pid_text), int(cores_text)
    except ValueError:
        raise RecordRefusedError(f"{where} reads {value[:80]!r}, not 'identity|pid|cores': "
                                 "a process outside the run wrote it") from None
    if pid <= 1 or usable < 1:
        raise RecordRefusedError(f"{where} names pid {pid} with {usable} cores: not a "
                                 "worker's; a process outside the run wrote it")
    if identity and identity == host_identity() and process_gone(pid):
        raise RecordRefusedError(
            f"{where} names pid {pid}, which is not a live process on this host: a process "
            "outside the run wrote it, or the rank died (its shared-memory names would be "
            "another process's)")
    return identity, pid, usable


def read_host_records(store: Any, participants: Sequence[int], world_size: int
                      ) -> tuple[dict[str, list[int]], dict[int, int], list[int]]:
    """Reads and checks the host records of `participants` (all published).

    Returns:
        `(ranks by host identity, pid by rank, usable cores per rank)`.

    Raises:
        RecordRefusedError: a record is not signed with the run's secret (when it has one),
            is malformed, names a rank outside the world, or (on this host) a pid that is
            no live process or is another rank's too.
    """
    hosts: dict[str, list[int]] = {}
    pids: dict[int, int] = {}
    cores = []
    values = store.multi_get([f"peerflow/host/{r}" for r in participants])
    for r, value in zip(participants, values):
        identity, pid, usable = _host_record(r, value, world_size)
        if identity and pid in pids.values() and identity == host_identity():
            raise RecordRefusedError(f"redistribute: the host records of ranks "
                                     f"{[k for k, v in pids.items() if v == pid] + [r]} name "
                                     f"the same pid {pid}: a process outside the run wrote one")
        hosts.setdefault(identity, []).append(r)
        pids[r] = pid
        cores.append(usable)
    return hosts, pids, cores


def cached_shm_route(participants: Sequence[int], timeout: float, *, namespace: str = ""
                     ) -> ShmRoute | str:
    """`shm_route` of the rank set, made at the first call and kept for the world group.

    Every rank of `participants` calls it in the same order per `namespace`.
    """
    world = dist.group.WORLD
    routes = _ROUTES.get(world)
    if routes is None:
        routes = _ROUTES[world] = {}
        weakref.finalize(world, _release, routes)
    key = (namespace, tuple(participants))
    if key not in routes:
        routes[key] = shm_route(key[1], timeout, namespace=namespace)
    return routes[key]


def _release(routes: dict[Any, ShmRoute | str]) -> None:
    for route in routes.values():
        if isinstance(route, ShmRoute):
            route.release()
    routes.clear()


def check_transport(transport: str) -> None:
    """Raises `ValueError` naming the choices when `transport` is not one of them."""
    if transport not in TRANSPORTS:
        raise ValueError(f"redistribute: transport={transport!r}; use one of {TRANSPORTS}.")


def open_channel(participants: Sequence[int], transport: str, timeout: float
                 ) -> ExchangeChannel:
    """Returns the channel of one `redistribute` call on `participants`.

    Call on every rank of `participants`, once per call, in the same order.

    Raises:
        ValueError: `transport` is unknown, or `shm` where the ranks share no memory.
        WorkerFailedError: a rank did not publish its host within `timeout`.
    """
    check_transport(transport)
    if transport == "gloo":
        return _GLOO
    route = cached_shm_route(participants, timeout)
    if isinstance(route, str):
        if transport == "shm":
            raise ValueError(f"redistribute: transport='shm' but {route}; use "
                             "transport='auto' (gloo between hosts) or 'gloo'.")
        return _GLOO
    return route.begin_call()
