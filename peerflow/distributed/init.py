"""Starting torch.distributed with timeouts and the fault monitor.

Call sequence on every rank (the launcher's entry does 1–2 before `run_worker`):

1. `ctx = init_distributed(backend="auto", timeout=fault_timeout)` — reads the
   `torchrun`-style environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
   `MASTER_PORT`), makes this rank's device current and starts the default group with
   the contract's backends (`peerflow.distributed.devices.group_backend`: host tensors
   over gloo, device tensors over NCCL), sets the process group's timeout (the timeout
   of every collective), and starts the `FaultMonitor`. Idempotent: a second call
   returns the same context.
2. wrap work in `with stage("generate"): …` so failures name the stage;
3. `shutdown_distributed()` at the end (marks the rank done, destroys the group).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import attrs
import torch
import torch.distributed as dist

from peerflow.distributed import devices
from peerflow.distributed.fault_scope import current_monitor, set_monitor
from peerflow.distributed.faults import FaultMonitor
from peerflow.distributed.listen import (
    LOOPBACK,
    is_loopback,
    listening_store,
    spans_hosts,
    store_address,
)
from peerflow.distributed.round_store import generation_stores
from peerflow.distributed.signing import require_run_secret, run_secret, signed
from peerflow.errors import ConfigError

#: Environment variable naming a launcher-hosted fault store (`host:port`).
FAULT_STORE_ENV = "PEERFLOW_FAULT_STORE"
#: Environment variable holding the scope of that store's signed records: a nonce the
#: launcher draws per run, so a record signed in another run under the same secret (one
#: kept in a file across runs) is refused in this one.
FAULT_SCOPE_ENV = "PEERFLOW_FAULT_SCOPE"


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port free on `host` now (for a rendezvous endpoint or `init_method`)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@attrs.frozen(kw_only=True)
class DistContext:
    """What `init_distributed` set up for this process."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this host (selects the GPU)."""
    backend: str
    """The default group's backends: `gloo` on the host, `cpu:gloo,cuda:nccl` on a GPU."""
    device: torch.device
    """Where this rank's engines compute (`devices.rank_device`)."""
    host: str
    """This host's name."""
    timeout: float
    """Seconds every collective and p2p exchange may take."""
    store: Any
    """The store the fault monitor uses."""
    monitor: FaultMonitor | None
    """This rank's fault monitor (`None` when started with `monitor=False`)."""


_CONTEXT: DistContext | None = None


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ConfigError(
                f"environment variable {name} is not set; start workers with `peerflow train`, "
                "`torchrun` or the Ray launcher, or pass rank and world_size explicitly."
            )
        return default
    return int(value)


def fault_store(default_store: Any, timeout: float) -> Any:
    """The store a rank's fault channel uses: the launcher's, else `default_store`.

    The launcher's (`FAULT_STORE_ENV`) has its records signed under `FAULT_SCOPE_ENV`.
    """
    address = os.environ.get(FAULT_STORE_ENV)
    if not address:
        return signed(default_store)
    host, _, port = address.rpartition(":")
    return signed(dist.TCPStore(host, int(port), is_master=False,
                                timeout=datetime.timedelta(seconds=max(timeout, 30.0))),
                  scope=os.environ.get(FAULT_SCOPE_ENV, ""))


#: The variables that choose the interface gloo's and NCCL's sockets listen on.
SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def keep_sockets_on_loopback() -> None:
    """On one machine (`MASTER_ADDR` loopback), gloo and NCCL listen on `lo` only.

    NCCL's bootstrap (and gloo without `GLOO_SOCKET_IFNAME`) would pick an interface
    other than loopback — NCCL skips `lo` unless told — and listen there for the whole
    run, reachable from the network. A value the operator set is kept.
    """
    if is_loopback(os.environ.get("MASTER_ADDR", LOOPBACK)):
        for name in SOCKET_IFNAME_ENVS:
            os.environ.setdefault(name, "lo")


def check_run_secret() -> None:
    """Refuses a job across hosts that has no run secret.

    Raises:
        ConfigError: the job spans hosts (or the launcher's fault store is not on
            loopback) and neither `PEERFLOW_RUN_SECRET` nor `PEERFLOW_RUN_SECRET_FILE` is
            set, or the secret set is invalid.
    """
    fault_host = os.environ.get(FAULT_STORE_ENV, "127.0.0.1:0").rpartition(":")[0]
    if spans_hosts() or not is_loopback(fault_host):
        require_run_secret(f"this job spans hosts (MASTER_ADDR="
                           f"{os.environ.get('MASTER_ADDR')}, fault store on {fault_host})")
    else:
        run_secret()  # a set but invalid secret is refused here too


def _env_store(rank: int, timeout: float) -> Any:
    """The `env://` store, its server listening only where its peers reach it."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT")
    delta = datetime.timedelta(seconds=timeout)
    if rank == 0:
        return listening_store(store_address(host), port, timeout=timeout)
    return dist.TCPStore(host if spans_hosts() else LOOPBACK, port, is_master=False,
                         timeout=delta)


def _port_in_use(init_method: str | None) -> str:
    port = os.environ.get("MASTER_PORT", "?")
    where = init_method or f"MASTER_PORT={port} on MASTER_ADDR={os.environ.get('MASTER_ADDR')}"
    if init_method:
        port = init_method.rsplit(":", 1)[-1]
    return (f"{where}: the port is already in use (another run, or a process still holding "
            f"it); pick a free port (MASTER_PORT=… or torchrun --master-port …), or find the "
            f"holder with `ss -ltnp 'sport = :{port}'`.")


def init_distributed(
    backend: str = "auto",
    timeout: float = 60.0,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    monitor: bool = True,
    wait_timeout: float | None = None,
) -> DistContext:
    """Initialises the default process group and the fault monitor (idempotent).

    Args:
        backend: `auto` (this rank's accelerator when there is one, with the contract's
            backends; else the host over gloo) or `gloo` (the host only, even beside an
            accelerator).
        timeout: Seconds before a dead peer or a lost store fails the run (the run's
            `runtime.fault_timeout`): the fault monitor's and the store's bound.
        rank: Global rank; defaults to `$RANK`.
        world_size: Number of ranks; defaults to `$WORLD_SIZE`.
        init_method: URL for `init_process_group`; defaults to `env://`.
        monitor: Start the heartbeat/abort monitor.
        wait_timeout: Seconds each collective and peer wait may take while the peer
            lives (`runtime.peer_wait_timeout`); defaults to `timeout`.

    Returns:
        The process's `DistContext`.

    Raises:
        ConfigError: the environment does not describe a job, or the backend is unknown.
    """
    global _CONTEXT
    if _CONTEXT is not None and dist.is_initialized():
        return _CONTEXT
    if backend not in ("auto", "gloo"):
        raise ConfigError(f"init_distributed: backend={backend!r}; use auto or gloo.")
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    local_rank = _env_int("LOCAL_RANK", 0)
    keep_sockets_on_loopback()
    device = devices.HOST if backend == "gloo" else devices.rank_device(local_rank)
    devices.use_device(device)
    backend = devices.group_backend(device)
    check_run_secret()
    generation = None  # under torchrun: stores of this worker generation (round_store)
    if init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        generation = generation_stores(rank, timeout)
    if not dist.is_initialized():
        try:
            if generation:
                where: dict[str, Any] = {"store": generation[0]}
            elif init_method is None:
                where = {"store": _env_store(rank, timeout)}
            else:
                where = {"init_method": init_method}
            dist.init_process_group(
                backend=backend, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=wait_timeout or timeout), **where)
        except (RuntimeError, OSError) as exc:
            if "address already in use" not in str(exc).lower():
                raise
            raise ConfigError(_port_in_use(init_method)) from None
    store = fault_store(generation[1] if generation
                        else dist.distributed_c10d._get_default_store(), timeout)
    fault_monitor = None
    if monitor:
        agent_store = os.environ.get(FAULT_STORE_ENV) or generation is not None
        fault_monitor = FaultMonitor(store=store, rank=rank, world_size=world_size,
                                     fault_timeout=timeout,
                                     store_owner=None if agent_store else 0).start()
        fault_monitor.install_sigterm_handler()
        set_monitor(fault_monitor)
    _CONTEXT = DistContext(rank=rank, world_size=world_size, local_rank=local_rank,
                           backend=backend, device=device, host=socket.gethostname(),
                           timeout=wait_timeout or timeout,
                           store=store, monitor=fault_monitor)
    return _CONTEXT


def dist_context() -> DistContext | None:
    """The context `init_distributed` returned, or `None`."""
    return _CONTEXT


def shutdown_distributed() -> None:
    """Marks this rank finished, stops the monitor and destroys the process group."""
    global _CONTEXT
    monitor = current_monitor()
    if monitor is not None:
        monitor.close()
        set_monitor(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTEXT = None
