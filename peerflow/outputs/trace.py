"""Per-rank Chrome-trace timelines (open `trace_rank{r}.json` in Perfetto or chrome://tracing).

Each rank owns one `Tracer`; `span(name, **args)` records a complete event ("ph": "X")
with wall-clock microsecond timestamps, so the files of all ranks line up when loaded
together, and the calling thread's CPU time in the span as `args.cpu_ms` (a span whose
`cpu_ms` is well below its duration waited: for a peer, a lock, or a core other
processes held). `flush()` rewrites the rank's file atomically with every event so far. A
module-level tracer (`set_tracer`) lets code anywhere call `span(...)` without passing a
tracer around; with none set, `span` does nothing.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from peerflow.checkpoint.atomic import write_text_atomic


class Tracer:
    """Collects one rank's trace events and writes them to `trace_rank{rank}.json`.

    Args:
        run_dir: Where the file goes; `None` keeps events in memory only.
        rank: Global rank (the trace's process id).
        enabled: `False` makes every call a no-op (`run.trace: false`).
        max_events: Oldest events are dropped beyond this many (bounds memory).
    """

    def __init__(self, run_dir: str | Path | None, rank: int = 0, *, enabled: bool = True,
                 max_events: int = 1_000_000) -> None:
        self.path = Path(run_dir) / f"trace_rank{rank}.json" if run_dir is not None else None
        self.rank = rank
        self.enabled = enabled
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wall0 = time.time_ns() // 1000
        self._perf0 = time.perf_counter()

    def now_us(self) -> float:
        """Wall-clock microseconds, from a monotonic clock anchored at construction."""
        return self._wall0 + (time.perf_counter() - self._perf0) * 1e6

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)
            if len(self.events) > self.max_events:
                del self.events[: len(self.events) - self.max_events]

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Records the enclosed block as one event named `name` with `args`."""
        if not self.enabled:
            yield
            return
        start, cpu = self.now_us(), time.thread_time()
        try:
            yield
        finally:
            self._add({"name": name, "ph": "X", "ts": start, "dur": self.now_us() - start,
                       "pid": self.rank, "tid": threading.get_ident() % 1_000_000,
                       "args": {**{k: _jsonable(v) for k, v in args.items()},
                                "cpu_ms": round((time.thread_time() - cpu) * 1e3, 3)}})

    def instant(self, name: str, **args: Any) -> None:
        """Records a point in time (e.g. "weights v3 live")."""
        if self.enabled:
            self._add({"name": name, "ph": "i", "s": "p", "ts": self.now_us(), "pid": self.rank,
                       "tid": threading.get_ident() % 1_000_000,
                       "args": {k: _jsonable(v) for k, v in args.items()}})

    def counter(self, name: str, **values: float) -> None:
        """Records counter values (drawn as a stacked graph, e.g. queue depths)."""
        if self.enabled:
            self._add({"name": name, "ph": "C", "ts": self.now_us(), "pid": self.rank,
                       "args": {k: float(v) for k, v in values.items()}})

    def flush(self) -> Path | None:
        """Writes every event so far to the rank's file (atomically); returns its path."""
        if not self.enabled or self.path is None:
            return None
        with self._lock:
            events = list(self.events)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        return write_text_atomic(
            self.path, json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)


_TRACER: Tracer | None = None


def set_tracer(tracer: Tracer | None) -> None:
    """Makes `tracer` this process's default (what module-level `span` records into)."""
    global _TRACER
    _TRACER = tracer


def get_tracer() -> Tracer | None:
    """Returns this process's default tracer, or `None`."""
    return _TRACER


@contextlib.contextmanager
def span(name: str, **args: Any) -> Iterator[None]:
    """`Tracer.span` on the process's default tracer; a no-op when none is set."""
    tracer = _TRACER
    if tracer is None:
        yield
        return
    with tracer.span(name, **args):
        yield
