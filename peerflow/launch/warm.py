"""Warm worker starts: workers forked from a server that has already imported torch.

A spawned worker starts a fresh interpreter and imports torch, transformers and
PeerFlow's worker modules again: about 7 s of CPU per worker on a 2-core machine, more
than a short run's training. The elastic launcher instead starts its workers through
multiprocessing's fork server, with `peerflow.launch.preload` imported there once: each
worker is a fork of an interpreter that has those modules already, and shares their pages
with its siblings. The server has only imported modules (one thread, no CUDA context, no
torch thread pool), the state in which forking is safe.

`peerflow train` and `peerflow eval` start the server first thing, so its imports overlap
the launcher's own (config validation, plugin loading). A fork-server worker inherits the
server's environment, not the launcher's at launch time: `environment_changes` gives what
changed since the server started, and `worker_entry` applies it, so a worker sees what a
spawned one would.

The fork server is started by `python -c …`, which puts the working directory first on
`sys.path`: run from the parent folder of a clone, it would import the clone's `peerflow/`
folder (a namespace package, hiding the installed package's `__init__`) and every worker
forked from it would inherit that module. The server therefore starts with
`PYTHONSAFEPATH=1` (`python -P`), and its workers drop the variable again. Python 3.10 has
no safe path: there, a launcher whose working directory holds a `peerflow` entry spawns its
workers instead (a spawned worker takes the launcher's `sys.path`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The module whose import warms the fork server (`peerflow.launch.preload`).
PRELOAD = "peerflow.launch.preload"
#: The environment the fork server was started with (`None`: this process did not start it).
_server_environ: dict[str, str] | None = None
#: Set in the fork server's environment so that `python -c` leaves the working directory off
#: `sys.path` (Python 3.11+).
SAFE_PATH = {"PYTHONSAFEPATH": "1"}


def _working_directory_shadows_peerflow() -> bool:
    """Whether `import peerflow` from the working directory would find something there."""
    cwd = Path.cwd()
    return (cwd / "peerflow").is_dir() or (cwd / "peerflow.py").is_file()


def start_warm_server() -> bool:
    """Starts the fork server with `PRELOAD` imported, unless it runs already.

    Returns:
        Whether workers can be forked from a server whose environment is known (this
        platform has fork servers, and this process started the one that runs).
    """
    global _server_environ
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    if _server_environ is None:
        server = multiprocessing.forkserver._forkserver  # noqa: SLF001 (the stdlib singleton)
        if server._forkserver_pid is not None:  # noqa: SLF001 another part of this process
            return False
        if sys.version_info < (3, 11) and _working_directory_shadows_peerflow():
            return False
        multiprocessing.set_forkserver_preload([PRELOAD])
        _server_environ = dict(os.environ, **SAFE_PATH)
        before = dict(os.environ)
        os.environ.update(SAFE_PATH)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            apply_environment_changes({name: before.get(name) for name in SAFE_PATH})
    return True


def warm_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context to start workers with: the warm fork server's, or spawn.

    Pass `environment_changes()` to what the process runs, and apply it there first.
    """
    return multiprocessing.get_context("forkserver" if start_warm_server() else "spawn")


def environment_changes() -> dict[str, str | None]:
    """What a worker forked now must change in its environment (`None`: remove the name).

    Empty when this process did not start the fork server.
    """
    if _server_environ is None:
        return {}
    changes: dict[str, str | None] = {
        name: value for name, value in os.environ.items()
        if _server_environ.get(name) != value}
    changes.update({name: None for name in _server_environ if name not in os.environ})
    return changes


def apply_environment_changes(changes: dict[str, str | None]) -> None:
    """Sets (or, for `None`, removes) each variable of `changes` in this process."""
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def warm_process(target: Callable[..., Any], args: tuple = (), **kwargs: Any) -> Any:
    """A process (not started) that runs `target(*args)`, forked from the warm fork server.

    It starts with `PRELOAD` imported and this process's environment as it is now
    (`environment_changes`, applied before `target`). Like any fork-server child it ends
    with `os._exit`, without the interpreter's shutdown. Make its queues with
    `warm_context().Queue()`.
    """
    return warm_context().Process(target=_in_environment,
                                  args=(environment_changes(), target, args), **kwargs)


def _in_environment(changes: dict[str, str | None], target: Callable[..., Any],
                    args: tuple) -> None:
    apply_environment_changes(changes)
    target(*args)
