"""Process helpers for tests that stop workers."""

from __future__ import annotations

from pathlib import Path


def process_gone(pid: int) -> bool:
    """Whether a process has exited (a zombie awaiting its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
