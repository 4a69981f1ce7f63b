"""The progress bar (rich) and the run's lines on stderr, quiet off the reporting rank.

Every logged step prints its line, every evaluation its own, the run's end a summary
(`peerflow.outputs.console`). On a terminal they print above a live bar showing steps
done, the rate, time left and the latest reward; elsewhere (CI logs, files) as plain lines.

Worker processes switch the libraries' own progress bars off (`quiet_library_progress`):
one bar per worker and engine for loading weights said nothing the step lines do not.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from peerflow.outputs.console import eval_line, step_line

#: Environment variables that keep Hugging Face Hub, transformers and datasets bars off
#: in a process that imports them later.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def quiet_library_progress() -> None:
    """Switches off the progress bars of Hugging Face Hub, transformers and datasets.

    Called once at a worker's start-up: transformers drew a "Loading weights" bar per
    worker and engine, and one when a model directory was written. Modules imported
    already (a warm fork server preloads transformers) are switched off directly; the
    environment covers later imports. A variable the user set is left as it is.
    """
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] not in ("1", "true", "True", "TRUE"):
        return
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        from datasets.utils import disable_progress_bars as disable_datasets_bars

        disable_datasets_bars()


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

    def update(self, step: int, metrics: Mapping[str, Any] | None = None, *,
               line: bool = True) -> None:
        """Marks `step` done; prints its line (when `line`) and its evaluation's line.

        The evaluation before the first step (step 0, or the step a resumed run starts
        from) prints only its evaluation line.
        """
        metrics = metrics or {}
        if step:
            self.done = step
        if not self.enabled:
            return
        if self._progress is not None and step:
            reward = metrics.get("reward/mean")
            info = f"reward {reward:.3g}" if isinstance(reward, int | float) else ""
            self._progress.update(self._task, completed=step, info=info)
        if line and step and any(not n.startswith("eval/") and n != "step" for n in metrics):
            self.print(step_line(step, self.total, metrics))
        if any(name.startswith("eval/") for name in metrics):
            self.print(eval_line(step, self.total, metrics))

    def print(self, text: str) -> None:
        """Prints `text` to stderr (above the live bar, on a terminal); quiet if disabled."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=sys.stderr, flush=True)

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
