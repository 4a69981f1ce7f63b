"""What every launched worker process runs first: set up, then call the worker function.

`worker_entry` is the target the elastic launcher and the Ray actors call. It pins torch
threads, initialises torch.distributed and the fault monitor with the run's
`fault_timeout`, calls the entry function (by default
`peerflow.worker.main:run_worker(config_path, overrides, run_dir, resume)`), and, if that
raises, reports the failure to every rank before re-raising, so the launcher exits
non-zero and the other ranks exit naming this one.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from peerflow.config.schema import RuntimeConfig
from peerflow.errors import INTERRUPTED_EXIT

#: `runtime.stop_grace`'s default.
STOP_GRACE = attrs.fields(RuntimeConfig).stop_grace.default
#: The worker function `peerflow train` runs in every process.
DEFAULT_ENTRY = "peerflow.worker.main:run_worker"


def resolve_entry(entry: str) -> Callable[..., Any]:
    """Imports `module:function`.

    Raises:
        ValueError: `entry` is not of that form or does not resolve.
    """
    module, sep, name = entry.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"worker entry {entry!r}: expected 'module:function', e.g. "
                         f"{DEFAULT_ENTRY!r}.")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker entry {entry!r} does not resolve: {exc}") from exc


@attrs.frozen(kw_only=True)
class WorkerCommand:
    """What every worker process runs: the arguments of `worker_entry`."""

    entry: str
    """`module:function` every worker runs."""
    config_path: str | None
    """Run config YAML."""
    overrides: tuple[str, ...] = attrs.field(converter=tuple)
    """`--set` assignments."""
    run_dir: str
    """Run directory."""
    resume: str | None
    """Run directory to resume from."""
    fault_timeout: float
    """Seconds within which all ranks exit after a failure."""
    torch_threads: int = 1
    """torch threads per worker."""
    stop_grace: float = STOP_GRACE
    """Seconds a graceful stop may take (`runtime.stop_grace`)."""
    wait_timeout: float | None = None
    """Seconds a rank waits for a live peer (`runtime.peer_wait_timeout`; `None`:
    `fault_timeout`)."""
    environ: dict[str, str | None] = attrs.field(factory=dict)
    """Environment variables a worker sets (`None`: removes) first: what changed in the
    launcher since the fork server it starts from did (`peerflow.launch.warm`)."""
    checkpoint: str | None = None
    """A checkpoint or run directory the entry only reads (`peerflow eval`): handed to the
    entry in `resume`'s place, while logs and outputs stay in `run_dir`."""

    def args(self) -> tuple[Any, ...]:
        """Returns `worker_entry`'s positional arguments (picklable for spawned workers)."""
        return (self.entry, self.config_path, list(self.overrides), self.run_dir, self.resume,
                self.fault_timeout, self.torch_threads, self.stop_grace, self.wait_timeout,
                dict(self.environ), self.checkpoint)

    @property
    def logs_dir(self) -> str:
        """The run directory whose logs a failure message points to."""
        return self.resume or self.run_dir


def worker_entry(
    entry: str,
    config_path: str | None,
    overrides: Sequence[str],
    run_dir: str,
    resume: str | None,
    fault_timeout: float,
    torch_threads: int = 1,
    stop_grace: float = STOP_GRACE,
    wait_timeout: float | None = None,
    environ: dict[str, str | None] | None = None,
    checkpoint: str | None = None,
) -> None:
    """Runs one worker process (called by the launchers, on every rank).

    Args:
        entry: `module:function` taking `(config_path, overrides, run_dir, resume)`.
        config_path: Run config YAML.
        overrides: `--set` assignments.
        run_dir: Run directory.
        resume: Run directory to resume from, or `None`.
        fault_timeout: Seconds within which every rank exits after a peer fails.
        torch_threads: torch intra-op threads of this process.
        stop_grace: Seconds a graceful stop may take before this rank stops at once.
        wait_timeout: Seconds each collective and peer wait may take while the peer lives.
        environ: Environment variables to set (`None`: remove) before anything else.
        checkpoint: A directory the entry only reads (`peerflow eval`), given in `resume`'s place.

    A worker started by a launcher (`LAUNCHER_PID_ENV`) exits within about a second of
    that launcher's death, quietly (`peerflow.launch.lifeline`), and adds its pid to the
    run lock (`register_worker`). A first SIGINT or SIGTERM asks every rank to stop at
    the next step boundary (`peerflow.distributed.stop`); a worker that stopped that way
    exits with `INTERRUPTED_EXIT` after finishing cleanly. A later one stops it at once.
    """
    import torch

    from peerflow.distributed import handle_failure, init_distributed, shutdown_distributed
    from peerflow.distributed.ranklog import append_to_rank_log, open_rank_log
    from peerflow.distributed.stop import WorkerStopHandler, read_stop
    from peerflow.launch.lifeline import hold_to_launcher
    from peerflow.launch.warm import apply_environment_changes
    from peerflow.outputs.rundir import register_worker

    check_installed_peerflow()
    apply_environment_changes(environ or {})
    torch.set_num_threads(max(1, torch_threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ctx = init_distributed(timeout=fault_timeout, wait_timeout=wait_timeout)
    open_rank_log(resume or run_dir, ctx.rank)
    hold_to_launcher(note=append_to_rank_log)  # exits within a second of its death
    register_worker(run_dir)  # the run lock names every local worker
    append_to_rank_log(f"rank {ctx.rank} on {ctx.host}: engines compute on {ctx.device}; "
                       f"process groups carry {ctx.backend}")
    monitor = ctx.monitor
    stopped = None
    if monitor is not None:
        monitor.stop_grace = stop_grace
        WorkerStopHandler(monitor=monitor).install()
    try:
        resolve_entry(entry)(config_path, list(overrides), run_dir,
                             resume if checkpoint is None else checkpoint)
        stopped = read_stop(monitor.store) if monitor is not None else None
    except KeyboardInterrupt:  # Ctrl-C reaches every local worker; the launcher reports it
        append_to_rank_log(f"rank {ctx.rank} (pid {os.getpid()}) interrupted (SIGINT) at:\n"
                           + traceback.format_exc())
        if monitor is not None:
            monitor.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED_EXIT)  # skip collective teardown with peers that are leaving
    except BaseException as exc:
        _log_error(ctx.rank, f"rank {ctx.rank} (host {ctx.host}, pid {os.getpid()}) raised:\n"
                   + traceback.format_exc(), monitor)
        handle_failure(exc, monitor)
        raise
    finally:
        shutdown_distributed()
    if stopped is not None:  # finished cleanly, but before run.steps
        append_to_rank_log(f"rank {ctx.rank}: {stopped.message('stop requested')}")
        sys.exit(INTERRUPTED_EXIT)


def check_installed_peerflow() -> None:
    """Raises when this process imported a `peerflow/` folder instead of the package.

    A folder without `__init__.py` on `sys.path` before the installed package (the clone's
    folder, when a worker was started from its parent with the working directory first on
    `sys.path`: `torchrun -m`, a Ray worker) becomes a namespace package that hides the
    real one's `__init__`; every plugin then fails to load. `peerflow train` starts its
    workers so this does not happen (`peerflow.launch.warm`); other launchers are told.

    Raises:
        ImportError: naming the folder that was imported and the fix.
    """
    package = sys.modules.get("peerflow")
    if package is None or getattr(package, "__file__", None) is not None:
        return
    folders = ", ".join(str(path) for path in getattr(package, "__path__", ()))
    raise ImportError(
        f"this worker imported the folder {folders} as `peerflow` instead of the installed "
        "package (its working directory comes first on sys.path). Start the run from "
        "another directory, or run `peerflow train` (its workers ignore the working "
        "directory); under torchrun use `--no-python peerflow train …` instead of "
        "`-m peerflow`.")


def _log_error(rank: int, text: str, monitor: Any) -> None:
    """Writes a failure to the rank log, or to stderr where it cannot (a full disk).

    The launcher is told (`mark_log_unwritten`) so that its message points to stderr.
    """
    from peerflow.distributed.ranklog import (
        append_to_rank_log,
        current_rank_log,
        mark_log_unwritten,
    )

    why = append_to_rank_log(text)
    if why is None:
        return
    print(f"peerflow: rank {rank} could not write its log {current_rank_log()} ({why}); "
          f"its error:\n{text}", file=sys.stderr, flush=True)
    if monitor is not None:
        mark_log_unwritten(monitor.store, rank, why)
