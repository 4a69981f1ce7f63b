"""The launcher's side of fault handling: a store it owns and a watcher of local workers.

The launcher hosts a `TCPStore` and passes its address to the workers
(`PEERFLOW_FAULT_STORE`), so the fault channel outlives any worker. A thread polls the
pids the workers recorded there; a worker process that is gone (or a zombie) before it
marked itself done gets an abort record naming its rank, host and last stage at once —
faster than heartbeats, and before the elastic agent starts terminating the others.
"""

from __future__ import annotations

import contextlib
import os
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
from peerflow.distributed.init import FAULT_STORE_ENV
from peerflow.distributed.procs import process_gone
from peerflow.distributed.stages import PREFIX


@attrs.define(eq=False)
class FaultStore:
    """A launcher-hosted store for the fault channel, plus the local-worker watcher."""

    world_size: int
    host: str = "127.0.0.1"
    poll_s: float = 0.1
    store: dist.TCPStore = attrs.field(init=False)
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None

    def __attrs_post_init__(self) -> None:
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)

    @property
    def address(self) -> str:
        """`host:port` the workers connect to."""
        return f"{self.host}:{self.store.port}"

    def export(self) -> None:
        """Puts the address in this process's environment (inherited by the workers)."""
        os.environ[FAULT_STORE_ENV] = self.address

    def start_watching(self) -> FaultStore:
        """Starts the thread that notices local worker processes disappearing."""
        self._thread = threading.Thread(target=self._loop, name="peerflow-launcher-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the watcher and removes the address from the environment."""
        self._stop.set()
        os.environ.pop(FAULT_STORE_ENV, None)
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
                host, _, pid = self.store.get(key).decode().rpartition(":")
                if host == me and process_gone(int(pid)):
                    self.report(rank, f"worker process {pid} exited without finishing "
                                "(killed, crashed or out of memory)")
                    break
