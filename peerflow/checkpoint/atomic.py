"""The one way PeerFlow writes a file or directory atomically.

`atomic_path(final)` yields a temporary name beside `final`; when the block succeeds the
temporary is flushed to disk and renamed onto `final` (`os.replace`, atomic on POSIX), so a
crash never leaves a half-written file under its final name. On an exception the
temporary is removed and `final` is untouched. Every checkpoint, config, metrics rewrite,
trace and cached model goes through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _fsync(path: Path) -> None:
    if path.is_file():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `final`, renamed onto `final` when the block succeeds.

    The caller writes a file (or creates a directory) at the yielded path. Its name is
    unique to this process (pid and a random suffix), so concurrent writers never share it.

    Args:
        final: Where the file or directory must appear; its parent is created if missing.

    Raises:
        OSError: the rename failed (e.g. `final` is a non-empty directory); the temporary
            is removed first.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}.{secrets.token_hex(3)}")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Writes `text` to `path` atomically and returns `path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Writes `data` as indented, key-sorted JSON to `path` atomically and returns `path`."""
    return write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)
