"""The launcher's side of fault handling: a store it owns and a watcher of local workers.

The launcher hosts a `TCPStore` and passes its address to the workers
(`PEERFLOW_FAULT_STORE`), so the fault channel outlives any worker. A thread polls the
pids the workers recorded there; a worker process that is gone (or a zombie) before it
marked itself done gets an abort record naming its rank, host and last stage at once —
faster than heartbeats, and before the elastic agent starts terminating the others.

The store listens on `host` only (loopback for a run on one machine), and its records are
signed with the run's secret (`peerflow.distributed.signing`): the launcher takes it
from the environment, or generates one for a run on one host, and hands it to the
workers in `PEERFLOW_RUN_SECRET`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading

import attrs
import torch.distributed as dist

from peerflow.distributed.failure import (
    FailureRecord,
    publish_failure,
    rank_info,
    read_failure,
)
from peerflow.distributed.init import FAULT_SCOPE_ENV, FAULT_STORE_ENV
from peerflow.distributed.listen import LOOPBACK, is_loopback, listening_store
from peerflow.distributed.procs import process_gone
from peerflow.distributed.signing import (
    RUN_SECRET_ENV,
    RecordRefusedError,
    SignedStore,
    new_run_secret,
    require_run_secret,
    run_secret,
    signed,
)
from peerflow.distributed.stages import PREFIX


def launcher_secret(host: str) -> bytes:
    """The run's secret: the operator's, else (a run on one host) a new one.

    Raises:
        ConfigError: `host` is not loopback (workers on other machines) and no secret is set.
    """
    if not is_loopback(host):
        return require_run_secret(f"the launcher's fault store listens on {host}")
    return run_secret() or new_run_secret().encode()


@attrs.define(eq=False)
class FaultStore:
    """A launcher-hosted store for the fault channel, plus the local-worker watcher."""

    world_size: int
    host: str = LOOPBACK
    poll_s: float = 0.1
    raw: dist.TCPStore = attrs.field(init=False)
    """The store server (listening on `host` only)."""
    store: SignedStore = attrs.field(init=False)
    """`raw` with the run's records signed and checked."""
    scope: str = attrs.field(factory=lambda: secrets.token_hex(8))
    """This run's nonce, bound into every record's tag (`FAULT_SCOPE_ENV`): a record
    signed in another run under the same secret is refused."""
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None
    _exported: list[str] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self.raw = listening_store(self.host, 0)
        self.store = signed(self.raw, launcher_secret(self.host), scope=self.scope)

    @property
    def address(self) -> str:
        """`host:port` the workers connect to."""
        return f"{self.host}:{self.raw.port}"

    @property
    def environment(self) -> dict[str, str]:
        """What a worker needs to use the store: its address and the run's secret."""
        return {FAULT_STORE_ENV: self.address, FAULT_SCOPE_ENV: self.scope,
                RUN_SECRET_ENV: (self.store.secret or b"").decode()}

    def export(self) -> None:
        """Puts `environment` in this process's environment (inherited by the workers)."""
        self._exported = [name for name in self.environment if name not in os.environ]
        os.environ.update(self.environment)

    def start_watching(self) -> FaultStore:
        """Starts the thread that notices local worker processes disappearing."""
        self._thread = threading.Thread(target=self._loop, name="peerflow-launcher-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the watcher and removes the address from the environment."""
        self._stop.set()
        for name in self._exported:
            os.environ.pop(name, None)
        if self._thread is not None:
            self._thread.join(timeout=2)

    def failure(self) -> FailureRecord | None:
        """The published failure, if any."""
        with contextlib.suppress(Exception):
            return read_failure(self.store)
        return None

    def report(self, rank: int, reason: str) -> FailureRecord:
        """Publishes a failure of `rank` found by the launcher (first record wins)."""
        host, stage = rank_info(self.store, rank)
        record = FailureRecord(rank=rank, host=host, stage=stage, reason=reason, reporter=-1)
        return publish_failure(self.store, record)

    def _loop(self) -> None:
        me = socket.gethostname()
        while not self._stop.wait(self.poll_s):
            if self.failure() is not None:
                continue
            for rank in range(self.world_size):
                key = f"{PREFIX}host/{rank}"
                if not self.store.check([key]) or self.store.check([f"{PREFIX}done/{rank}"]):
                    continue
                try:
                    host, _, pid = self.store.get(key).decode().rpartition(":")
                except RecordRefusedError:  # overwritten by a stranger since the check
                    continue
                if host == me and pid.isdigit() and process_gone(int(pid)):
                    self.report(rank, f"worker process {pid} exited without finishing "
                                "(killed, crashed or out of memory)")
                    break
