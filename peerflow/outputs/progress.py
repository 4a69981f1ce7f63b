"""Progress bars for training steps and generation (rich), quiet off rank 0.

On a terminal the bar shows steps done, the rate, time left and the latest reward; when
stderr is not a terminal (CI logs, files) one plain line is printed per step instead.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

#: Metrics shown next to the bar, when present.
SHOWN = ("reward/mean", "response_length/mean", "kl/mean", "time/step")


def _summary(metrics: Mapping[str, Any]) -> str:
    parts = []
    for name in SHOWN:
        value = metrics.get(name)
        if isinstance(value, int | float):
            parts.append(f"{name}={value:.3g}")
    return " ".join(parts)


class StepProgress(contextlib.AbstractContextManager["StepProgress"]):
    """A progress bar over training steps with an optional generation sub-bar.

    Args:
        total: Steps in the run.
        start: Steps already done (a resumed run).
        enabled: Draw anything at all (pass `rank == 0`).
        live: Use a live rich bar; default: whether stderr is a terminal.
    """

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True,
                 live: bool | None = None) -> None:
        self.total = total
        self.done = start
        self.enabled = enabled
        self.live = enabled and (sys.stderr.isatty() if live is None else live)
        self._progress: Any = None
        self._task: Any = None
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                console=Console(stderr=True), transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total, completed=start, info="")

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Marks `step` done and shows its headline metrics."""
        self.done = step
        if not self.enabled:
            return
        info = _summary(metrics or {})
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        else:
            print(f"step {step}/{self.total} {info}".rstrip(), file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def generation(self, total: int, description: str = "generate") -> Iterator[Any]:
        """A sub-bar for one generation phase; yields `advance(n=1)`."""
        if self._progress is None:
            yield lambda n=1: None
            return
        task = self._progress.add_task(description, total=total, info="")
        try:
            yield lambda n=1: self._progress.advance(task, n)
        finally:
            self._progress.remove_task(task)

    def close(self) -> None:
        """Stops the live display. Safe to call twice."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __exit__(self, *exc: object) -> None:
        self.close()
