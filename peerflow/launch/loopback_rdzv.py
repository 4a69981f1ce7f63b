"""The elastic agent's rendezvous on one machine, with its stores on loopback only.

torch's `c10d` rendezvous makes two `TCPStore` servers in the launcher: the rendezvous
store (at `rdzv_endpoint`) and the store the workers bootstrap from (`MASTER_ADDR`,
`MASTER_PORT`, shared as the agent store); both listen on every interface. The
`peerflow-loopback` backend registered here is the same rendezvous
(`DynamicRendezvousHandler` over `C10dRendezvousBackend`) with both servers made by
`listening_store` on `127.0.0.1`.
"""

from __future__ import annotations

from typing import Any

from peerflow.distributed.listen import LOOPBACK, listening_store

#: `LaunchConfig.rdzv_backend` of a run on one machine.
BACKEND = "peerflow-loopback"
#: The rendezvous store's read timeout (torch's `c10d` default), seconds.
READ_TIMEOUT = 60


def _bootstrap_store(master_addr: str, master_port: int) -> Any:
    """The workers' store, made where torch's handler makes it (`master_addr` is loopback)."""
    return listening_store(LOOPBACK, master_port, multi_tenant=True)


def create_loopback_handler(params: Any) -> Any:
    """A `c10d` rendezvous handler whose stores listen on loopback (`params`: torch's)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LoopbackBackend(C10dRendezvousBackend):
        """`c10d`'s state backend under this backend's name (torch checks the two match)."""

        @property
        def name(self) -> str:
            return BACKEND

    store = listening_store(LOOPBACK, 0, timeout=params.get_as_int("read_timeout",
                                                                   READ_TIMEOUT))
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # torch makes the workers' store in this method (torch 2.4+); without it the store
    # would listen everywhere, so refuse to run rather than fall back.
    if not hasattr(handler, "_create_tcp_store_server"):
        raise RuntimeError("this torch's DynamicRendezvousHandler has no "
                           "_create_tcp_store_server; peerflow cannot keep the workers' "
                           "store on loopback (use the torch version PeerFlow pins)")
    handler._create_tcp_store_server = _bootstrap_store
    return handler


def register() -> str:
    """Registers the `peerflow-loopback` rendezvous backend (idempotent); returns its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_loopback_handler)  # same creator: a no-op
    return BACKEND
