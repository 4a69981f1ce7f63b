"""Each worker's own log file, `RUN_DIR/logs/rank{N}.log`: full tracebacks and fault notes.

A worker's exception reaches the user as one line through the failure record; the whole
traceback goes here (and so does the stack of a stage stuck past its deadline), so the
launcher can print where to look. Where the log cannot be written (a full disk), the
worker prints the traceback on its stderr and says so through the fault store
(`mark_log_unwritten`), and the launcher points there instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from peerflow.distributed.stages import PREFIX

_PATH: Path | None = None
_log = logging.getLogger(__name__)


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` of a run writes its log."""
    return Path(run_dir) / "logs" / f"rank{rank}.log"


def open_rank_log(run_dir: str | Path, rank: int) -> Path:
    """Makes this process write its log for `rank` under `run_dir`; returns the path."""
    global _PATH
    _PATH = rank_log_path(run_dir, rank)
    return _PATH


def current_rank_log() -> Path | None:
    """This process's log file (`None` before `open_rank_log`)."""
    return _PATH


def append_to_rank_log(text: str) -> str | None:
    """Appends a time-stamped entry to this process's log (nothing before `open_rank_log`).

    Never raises: logging must not hide the failure being logged.

    Returns:
        `None` when written (or no log is open), else why it could not be (e.g. a full
        disk), so the caller can put the text elsewhere.
    """
    if _PATH is None:
        return None
    try:
        _PATH.parent.mkdir(parents=True, exist_ok=True)
        with _PATH.open("a") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text.rstrip()}\n")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def say_in_rank_log(line: str) -> None:
    """Writes a note (a choice the engine made) to this rank's log and to the logger."""
    append_to_rank_log(line)
    _log.info("%s", line)


def mark_log_unwritten(store: Any, rank: int, why: str) -> None:
    """Tells the launcher (through the fault store) that rank `rank`'s log lacks its error."""
    with contextlib.suppress(Exception):
        store.set(f"{PREFIX}nolog/{rank}", why)


def log_unwritten(store: Any, rank: int) -> str | None:
    """Why rank `rank` could not write its error to its log, or `None`."""
    key = f"{PREFIX}nolog/{rank}"
    with contextlib.suppress(Exception):
        if store.check([key]):
            return store.get(key).decode()
    return None
