"""Whether a process on this host is still there (launcher watch, shared-memory cleanup)."""

from __future__ import annotations

import os


def process_gone(pid: int) -> bool:
    """Whether a local process has exited (a zombie awaiting its parent counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
