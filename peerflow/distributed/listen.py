"""Store servers that listen on one address, never on every interface.

`torch.distributed.TCPStore(host, port, is_master=True)` listens on `*:port` whatever
`host` says, so a run's control stores answered anyone who could reach the machine.
`listening_store` binds the socket itself, to the one address the store's clients use
(`127.0.0.1` for a run on one host, the interface that reaches `MASTER_ADDR` across
hosts), and hands it to the store (`master_listen_fd`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

import torch.distributed as dist

from peerflow.errors import ConfigError

#: Where the stores of a run on one host listen.
LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback interface."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def spans_hosts() -> bool:
    """Whether the job described by the environment runs on more than one host.

    torchrun says so (`WORLD_SIZE` above `LOCAL_WORLD_SIZE`); other launchers are
    judged by `MASTER_ADDR` (anything but loopback may be another machine).
    """
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world is not None and local is not None:
        return int(world) > int(local)
    return not is_loopback(os.environ.get("MASTER_ADDR", LOOPBACK))


def store_address(peer_host: str) -> str:
    """Where a store of this job listens: loopback on one host, else `bind_address`."""
    return bind_address(peer_host) if spans_hosts() else LOOPBACK


def bind_address(peer_host: str) -> str:
    """The local address a store should listen on so that peers reaching `peer_host` get it.

    Loopback for a loopback `peer_host`; else the address of the interface this machine
    reaches `peer_host` through (the named interface of a multi-host run: on the host
    that `peer_host` names, that address itself).

    Raises:
        ConfigError: `peer_host` does not resolve or cannot be routed to.
    """
    if is_loopback(peer_host):
        return LOOPBACK
    try:
        info = socket.getaddrinfo(peer_host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
            probe.connect(info[4])  # UDP: no packet is sent, the kernel picks the route
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"cannot find the local interface that reaches {peer_host!r} ({exc}); set "
            "MASTER_ADDR (torchrun --master-addr / --rdzv-endpoint) to an address of the "
            "run's first host that every host can reach.") from exc


def listening_store(host: str, port: int = 0, *, timeout: float = 300.0,
                    multi_tenant: bool = False) -> Any:
    """A `TCPStore` server listening on `host:port` only (`port` 0: any free port).

    Args:
        host: The local address to listen on (`bind_address`).
        port: The port; 0 picks a free one (read it from the store's `port`).
        timeout: Seconds the store's own client calls may wait.
        multi_tenant: Let other stores of this process on the same port share the server.

    Raises:
        OSError: the address cannot be bound (`EADDRINUSE`: the port is taken).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, multi_tenant=multi_tenant,
                              timeout=datetime.timedelta(seconds=timeout),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store
