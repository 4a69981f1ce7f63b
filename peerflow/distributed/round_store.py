"""Stores of one worker generation under torchrun, so a restart never reads stale keys.

torchrun's agents share one `TCPStore` server across rendezvous rounds
(`TORCHELASTIC_USE_AGENT_STORE=True`; the server lives in the first agent) and give every
generation of workers the same `MASTER_ADDR:MASTER_PORT`, with no per-round prefix. After
`--max-restarts` restarts the workers, the keys the previous generation wrote are still
there: gloo's peer addresses (a new rank connects to a dead process's port and fails,
`Connection refused`, using up a restart) and PeerFlow's fault keys (an old abort record
would stop the new generation at once). `TORCHELASTIC_RESTART_COUNT` cannot tell
generations apart: an agent restarting for a membership change does not count it, so
the agents' counts differ.

`generation_stores` gives each generation stores of its own: rank 0 starts a fresh
`TCPStore` server (the process group's store) and publishes its address with a random
nonce in the agent store; every other rank reads that, connects, and checks the nonce in
the fresh store — a stale address (a previous generation's rank 0, now gone) fails the
check or the connection, and the rank reads again until the deadline (both records are
signed under torchrun's job id, `TORCHELASTIC_RUN_ID`: another job's are refused). The fault channel
stays in the agent store (it outlives any worker) under a prefix made of the nonce.

Rank 0's store listens on loopback on one host, else on the interface that reaches
`MASTER_ADDR` (`peerflow.distributed.listen`); the address and nonce records are signed
with the run's secret (`peerflow.distributed.signing`), so a stranger who can write to
torchrun's agent store cannot point the ranks at a store of its own.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from typing import Any

import torch.distributed as dist

from peerflow.distributed.listen import LOOPBACK, listening_store, spans_hosts, store_address
from peerflow.distributed.signing import RecordRefusedError, signed

#: Agent-store key where rank 0 publishes `host:port:nonce` of the generation's store.
ADDRESS_KEY = "peerflow/generation/store"
#: Key in the generation's own store holding its nonce.
NONCE_KEY = "peerflow/generation/nonce"
#: torchrun's job id (`--rdzv-id`): the scope of the address and nonce records, so a
#: record signed in another job under the same secret is refused.
JOB_ENV = "TORCHELASTIC_RUN_ID"


def _store(host: str, port: int, timeout: float) -> Any:
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def generation_stores(rank: int, timeout: float) -> tuple[Any, Any]:
    """Returns `(process-group store, fault store)` of this worker generation.

    Args:
        rank: This worker's global rank.
        timeout: Seconds to wait for rank 0's store (the run's `fault_timeout`).

    Raises:
        TimeoutError: rank 0 did not publish a reachable store within `timeout`.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    job = os.environ.get(JOB_ENV, "")  # binds the address records to this torchrun job
    agent = signed(_store(host, port, timeout), scope=job)
    if rank == 0:
        nonce = uuid.uuid4().hex[:16]
        listen = store_address(host)
        own = listening_store(listen, 0, timeout=timeout)
        signed(own, agent.secret, scope=job).set(NONCE_KEY, nonce)
        agent.set(ADDRESS_KEY, f"{listen}:{own.port}:{nonce}")
    else:
        own, nonce = _connect(agent, timeout)
    return own, signed(dist.PrefixStore(f"peerflow/generation/{nonce}/", agent.raw),
                       agent.secret, scope=nonce)


def _connect(agent: Any, timeout: float) -> tuple[Any, str]:
    """Connects to the store rank 0 of this generation published (skipping stale ones)."""
    deadline = time.monotonic() + timeout
    address = "?"
    while True:
        try:
            address = agent.get(ADDRESS_KEY).decode()
            host, port, nonce = address.rsplit(":", 2)
            own = _store(host if spans_hosts() else LOOPBACK, int(port), min(2.0, timeout))
            if signed(own, agent.secret, scope=agent.scope).get(NONCE_KEY).decode() == nonce:
                own.set_timeout(datetime.timedelta(seconds=timeout))
                return own, nonce
        except (RuntimeError, OSError, ValueError, RecordRefusedError):
            pass  # a previous generation's rank 0, gone (or not listening yet), or a
            # record a stranger wrote (RecordRefusedError: logged, ignored)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 of this torchrun generation published no reachable store in "
                f"{ADDRESS_KEY!r} within {timeout:g} s (last seen: {address}); it did not "
                "start, or runtime.fault_timeout is shorter than its start-up")
        time.sleep(0.2)
