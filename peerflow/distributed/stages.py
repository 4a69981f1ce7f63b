"""What each rank is doing right now, with a deadline: the record behind `stage(...)`.

Every rank publishes a `StageRecord` (stage name, wall-clock start, deadline, detail such
as "reward 'char_match' on samples 16-31") in the fault store whenever it enters a stage.
Two uses:

* a rank's own monitor thread sees when its stage runs past its deadline (the main
  thread is stuck: a reward that never returns, a generate that hangs) and fails the run
  naming the rank, the stage, the detail and where the main thread is stuck;
* a rank whose collective timed out waiting for a peer finds the *culprit* — the rank
  that did not time out waiting itself, stuck longest in its stage — instead of blaming
  itself (`find_stuck_rank`).

Start times are wall-clock (`time.time()`), so across hosts they are only as good as the
hosts' clock synchronisation; they are used to order candidates and in messages.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from typing import Any

import attrs

#: Prefix of every key the fault machinery writes in the store.
PREFIX = "peerflow/faults/"


@attrs.frozen(kw_only=True)
class StageRecord:
    """One rank's current stage."""

    name: str
    """Stage name, e.g. `step 3 reward`."""
    since: float = attrs.field(factory=time.time)
    """Wall-clock time the stage was entered."""
    deadline: float | None = None
    """Seconds the stage may run; `None`: no deadline of its own."""
    detail: str = ""
    """What the stage is working on (a reward and its samples), for messages."""

    def overdue(self, now: float | None = None) -> bool:
        """Whether the stage has run past its deadline."""
        now = time.time() if now is None else now
        return self.deadline is not None and now - self.since > self.deadline

    def label(self) -> str:
        """`name` plus the detail in parentheses, as messages print it."""
        return f"{self.name} ({self.detail})" if self.detail else self.name

    def to_json(self) -> str:
        """Serialised form stored under `stage/<rank>`."""
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> StageRecord:
        """Parses `to_json`'s output."""
        return cls(**json.loads(text))


def read_stage(store: Any, rank: int) -> StageRecord | None:
    """The stage `rank` last published, or `None`."""
    key = f"{PREFIX}stage/{rank}"
    if not store.check([key]):
        return None
    return StageRecord.from_json(store.get(key))


def mark_timed_out(store: Any, rank: int) -> None:
    """Records that `rank` timed out *waiting* (so it is not the culprit)."""
    store.set(f"{PREFIX}waited/{rank}", "1")


def find_stuck_rank(store: Any, world_size: int, me: int) -> tuple[int, StageRecord] | None:
    """The rank everyone else is most likely waiting for.

    Candidates are the other ranks that have neither finished nor timed out waiting
    themselves; of those, the one that entered its current stage first.

    Returns:
        `(rank, its stage)`, or `None` when no other rank qualifies.
    """
    best: tuple[int, StageRecord] | None = None
    for rank in range(world_size):
        if rank == me or store.check([f"{PREFIX}done/{rank}"]) or store.check(
                [f"{PREFIX}waited/{rank}"]):
            continue
        record = read_stage(store, rank)
        if record is not None and (best is None or record.since < best[1].since):
            best = (rank, record)
    return best


def main_thread_location() -> str:
    """`file:line in function` where the main thread is executing now (`?` if unknown)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    last = traceback.extract_stack(frame)[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def main_thread_stack() -> str:
    """The main thread's current stack, formatted like a traceback."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""
