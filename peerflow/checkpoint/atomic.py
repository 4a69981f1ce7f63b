"""The one way PeerFlow writes a file or directory atomically.

`atomic_path(final)` yields a temporary name beside `final`; when the block succeeds the
temporary is flushed to disk and renamed onto `final` (`os.replace`, atomic on POSIX), so a
crash never leaves a half-written file under its final name. On an exception the
temporary is removed and `final` is untouched. Every checkpoint, config, metrics rewrite,
trace and cached model goes through it. A line appended to a JSONL file goes through
`append_line`: whole or absent. Their `OSError`s name the file they were writing.
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
        OSError: the write or the rename failed (e.g. a full disk, or `final` is a
            non-empty directory), naming `final`; the temporary is removed first.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}.{secrets.token_hex(3)}")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, final)
    except BaseException as exc:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno and exc.filename in (None, str(tmp)):
            raise with_path(OSError(exc.errno, exc.strerror), final) from exc
        raise


def append_line(path: str | Path, line: str, *, fd: int | None = None) -> None:
    """Appends one line to `path`, whole or not at all (JSONL files in the run directory).

    The line is written with `O_APPEND`; if the write fails part way (a full disk), the
    file is cut back to its size before the write, so a reader never meets half a line.

    Args:
        path: The file (created if missing).
        line: The text; a newline is added.
        fd: An open `O_APPEND` descriptor of `path` to write through (default: open it).

    Raises:
        OSError: the write failed; its message names `path`.
    """
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    own = fd is None
    try:
        if own:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        before = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)  # shrinking needs no space
            raise
        finally:
            if own:
                os.close(fd)
    except OSError as exc:
        raise with_path(exc, path) from None


def with_path(exc: OSError, path: str | Path) -> OSError:
    """`exc` naming `path` (writes report `[Errno 28] No space left on device` alone)."""
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), str(path))


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
