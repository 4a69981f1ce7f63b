"""A rank cut off from the fault store exits within the heartbeat bound, naming the lost
rank and host, even though its store calls block (issue 18: a cut link); a finished rank
leaves no store call running into interpreter shutdown, even when calls are slow."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from peerflow.distributed import PEER_FAILED_EXIT, FaultMonitor
from peerflow.distributed.stages import PREFIX


class Interposed:
    """A real store that runs `before(method_name)` ahead of every call."""

    def __init__(self, store, before) -> None:
        self.store, self.before = store, before

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            self.before(name)
            return method(*args, **kwargs)

        return call


class CutLink(Interposed):
    """A store whose calls block forever once `cut` is set, as over a link that is down."""

    def __init__(self, store) -> None:
        self.cut = threading.Event()
        super().__init__(store, lambda name: self.cut.is_set() and threading.Event().wait())


def test_a_cut_off_rank_exits_naming_the_lost_host(capsys) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    link = CutLink(store)
    exits: list[int] = []
    far = FaultMonitor(store=store, rank=0, world_size=2, fault_timeout=2.0, host="h0",
                       exit_process=lambda code: None).start()
    near = FaultMonitor(store=link, rank=1, world_size=2, fault_timeout=2.0, host="h1",
                        exit_process=exits.append).start()
    time.sleep(0.5)  # a few answered ticks: rank 1 knows its peer's host
    link.cut.set()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    far.close()
    assert exits == [PEER_FAILED_EXIT]
    err = capsys.readouterr().err
    assert "rank 0 (host h0) failed" in err, err
    assert "unreachable from rank 1 (host h1)" in err and "no answer for" in err, err
    assert near.closed


class SlowStore(Interposed):
    """A store whose `add` takes `delay` seconds once `slow` is set, as on a loaded rank
    (a tick of 3 s was measured with load average 28 on 2 cores)."""

    def __init__(self, store, delay: float) -> None:
        self.slow, self.entered = threading.Event(), threading.Event()
        super().__init__(store, self._maybe_slow)
        self.delay = delay

    def _maybe_slow(self, name: str) -> None:
        if name == "add" and self.slow.is_set():
            self.entered.set()
            time.sleep(self.delay)


def test_close_waits_for_a_slow_tick_so_no_store_call_outlives_the_interpreter() -> None:
    """A tick left in a store call at exit can abort the process ("terminate called
    without an active exception", SIGABRT): if the call returns while the interpreter
    finalizes, its thread cannot take the GIL back. close() gave up after 2 polls + 1 s."""
    store = SlowStore(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False),
                      delay=2.2)  # longer than the old limit (1.6 s here), within the new
    exits: list[int] = []
    monitor = FaultMonitor(store=store, rank=0, world_size=1, fault_timeout=6.0,
                           exit_process=exits.append).start()
    store.slow.set()
    assert store.entered.wait(10)  # a tick is inside the slow call
    monitor.close()
    assert not monitor._thread.is_alive() and not monitor._watchdog.is_alive()
    assert exits == [] and store.check([f"{PREFIX}done/0"])  # finished cleanly
