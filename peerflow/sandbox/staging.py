"""Paths the sandbox's unprivileged host uid cannot reach, reached through a stage.

bubblewrap started by root runs as an unprivileged host uid (`bubblewrap.HOST_UID`), so
it resolves every bind source as that uid: an interpreter under `/root/.pyenv` (mode 0700
`/root`) or a virtual environment in a private home cannot be found. Rather than loosen
the host's modes, the part of such a path below its last unsearchable directory is
bind-mounted, by root, onto an empty mount point under `STAGE_ROOT`, in a private mount
namespace made for that one program (`unshare --mount`; the host's mounts never change),
and bubblewrap binds it from there. The files themselves keep their modes: what is not
world-readable stays unreadable inside.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat

from peerflow.sandbox.base import SandboxUnavailableError

#: Root-owned empty mount points, one per staged directory or file.
STAGE_ROOT = "/run/peerflow-sandbox"


def _searchable(path: str, uid: int) -> bool:
    """Whether `uid` (in no group of the directory's) may search the directory `path`."""
    st = os.stat(path)
    bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXOTH
    return bool(st.st_mode & bit)


@functools.cache
def staged_root(path: str, uid: int) -> str | None:
    """The ancestor of `path` (or `path`) to stage so `uid` reaches it, or `None`.

    That is the child, on the way to `path`, of the deepest directory `uid` may not
    search; `None` when every directory on the way is searchable.
    """
    parts = path.strip("/").split("/")
    deepest = None
    for depth in range(len(parts)):
        directory = "/" + "/".join(parts[:depth])
        if not _searchable(directory, uid):
            deepest = depth
    return None if deepest is None else "/" + "/".join(parts[:deepest + 1])


@functools.cache
def mount_point(source: str) -> str:
    """The empty, root-owned mount point under `STAGE_ROOT` for `source` (made once).

    Raises:
        SandboxUnavailableError: where `STAGE_ROOT` cannot be made.
    """
    point = os.path.join(STAGE_ROOT, hashlib.sha256(source.encode()).hexdigest()[:16])
    try:
        os.makedirs(STAGE_ROOT, mode=0o755, exist_ok=True)
        st = os.lstat(STAGE_ROOT)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{STAGE_ROOT} is not a directory of this user's (a link, or "
                          "another user's); remove it")
        os.chmod(STAGE_ROOT, 0o755)
        if os.path.isdir(source):
            os.makedirs(point, mode=0o755, exist_ok=True)
        elif not os.path.exists(point):
            try:  # another thread may make it first
                os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                pass
    except OSError as exc:
        raise SandboxUnavailableError(
            f"the sandbox cannot make its mount point {point} ({exc}); it needs a writable "
            f"{os.path.dirname(STAGE_ROOT)} to reach {source}, which its unprivileged uid "
            "cannot search, or install the interpreter and packages where every user may "
            "read them (e.g. under /usr or /opt)") from exc
    return point


class Stager:
    """Collects the stages of one program's bind sources."""

    def __init__(self, uid: int | None) -> None:
        """`uid`: the host uid bubblewrap runs as; `None` stages nothing (not root)."""
        self.uid = uid
        self.stages: dict[str, str] = {}

    def reach(self, path: str) -> str:
        """The path bubblewrap should bind `path` from (`path` itself when reachable)."""
        path = os.path.realpath(path)
        root = None if self.uid is None else staged_root(path, self.uid)
        if root is None:
            return path
        point = self.stages.setdefault(root, mount_point(root))
        return point + path[len(root):]

    def pairs(self) -> list[tuple[str, str]]:
        """(source, mount point) pairs, for `local.exec_chain`."""
        return sorted(self.stages.items())
