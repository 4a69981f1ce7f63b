"""Single-machine launch through torch.distributed's elastic launcher (torchrun's engine)."""

from __future__ import annotations

import logging
import os
import signal
import uuid
from pathlib import Path

import attrs

from peerflow.distributed.listen import LOOPBACK
from peerflow.distributed.ranklog import log_unwritten, rank_log_path
from peerflow.distributed.stop import LauncherStopHandler, read_stop, stop_reason
from peerflow.errors import RunInterruptedError, WorkerFailedError
from peerflow.launch import loopback_rdzv
from peerflow.launch.entry import WorkerCommand, worker_entry
from peerflow.launch.lifeline import LAUNCHER_PID_ENV
from peerflow.launch.mainguard import main_module_hidden
from peerflow.launch.warm import environment_changes, start_warm_server
from peerflow.launch.watch import FaultStore


def failure_message(store: FaultStore, failures: dict[int, object] | None = None,
                    run_dir: str | None = None) -> str:
    """The launcher's one-paragraph account of a failed run, with where its log is."""
    record = store.failure()
    lines = []
    if record is not None:
        lines.append(record.message())
    for rank, failure in sorted((failures or {}).items()):
        code = getattr(failure, "exitcode", "?")
        signal = getattr(failure, "signal_name", lambda: "")()
        how = f"signal {signal}" if signal and code is not None and code < 0 else f"exit {code}"
        lines.append(f"  rank {rank}: {how}")
    if not lines:
        lines.append("a worker failed (no failure record was published)")
    unwritten = log_unwritten(store.store, record.rank) if record is not None else None
    if run_dir is not None and record is not None and unwritten is not None:
        lines.append(f"  rank {record.rank} could not write its log "
                     f"{rank_log_path(run_dir, record.rank)} ({unwritten}); its full "
                     "traceback is printed above, on this terminal (the worker's stderr)")
    elif run_dir is not None:
        log = rank_log_path(run_dir, record.rank) if record is not None else None
        if log is not None and log.is_file():
            lines.append(f"  full traceback: {log}")
        elif (Path(run_dir) / "logs").is_dir():
            lines.append(f"  worker logs: {Path(run_dir) / 'logs'}")
    return "\n".join(lines)


def stop_outcome(store: FaultStore, stopper: LauncherStopHandler,
                 stop_grace: float) -> RunInterruptedError | None:
    """How a run that was asked to stop ended, or `None` if nobody asked (a failure).

    Says where the ranks stopped gracefully, or that the graceful stop did not reach a
    step boundary within `stop_grace` and every worker was stopped at once.
    """
    reason = stopper.reason or stop_reason(store.store)
    stopped = read_stop(store.store)
    if stopped is not None:
        return RunInterruptedError(stopped.message(reason or "stop requested"))
    if reason is not None and store.failure() is None:
        return RunInterruptedError(
            f"interrupted ({reason}); the graceful stop did not reach a step boundary "
            f"within runtime.stop_grace={stop_grace:g} s, so every worker was stopped at "
            "once")
    return None


def launch_elastic(command: WorkerCommand, *, nprocs: int) -> None:
    """Starts `nprocs` workers with `elastic_launch`; returns when all finished cleanly.

    Workers are forked from the warm fork server (`peerflow.launch.warm`) where the
    platform has one, else spawned.

    The first SIGINT/SIGTERM asks every worker to stop at the next step boundary
    (`LauncherStopHandler`); a second one, or `command.stop_grace` passing, stops them
    at once through the elastic agent.

    Raises:
        RunInterruptedError: the run was stopped (says where, and whether a checkpoint
            was written at the stop).
        WorkerFailedError: a worker died or raised; the message names its rank, host and
            stage, and lists every worker's exit status.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    warm = start_warm_server()
    store = FaultStore(world_size=nprocs)
    store.export()
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # workers exit when this process dies
    store.start_watching()
    config = LaunchConfig(  # every store on loopback, the workers' MASTER_ADDR too
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"peerflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend=loopback_rdzv.register(), rdzv_endpoint=f"{LOOPBACK}:0",
        local_addr=LOOPBACK,
        rdzv_configs={"timeout": int(max(60, command.fault_timeout))}, max_restarts=0,
        # our own watcher names the failure first; the agent then stops the rest
        monitor_interval=0.5, start_method="forkserver" if warm else "spawn",
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGINT and SIGTERM: LauncherStopHandler
    )
    # The agent logs each failed child's traceback through torch's formatter, which
    # imports torch._dynamo (seconds on a busy machine); our own report names the failure.
    quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    stopper = LauncherStopHandler(
        store=store.store, grace=command.stop_grace,
        interrupt=lambda signum: SignalException("stopped at once", signal.Signals(signum)),
    ).install()
    try:
        if warm:  # after store.export(): workers see the store's address
            command = attrs.evolve(command, environ=environment_changes())
        with main_module_hidden():  # workers need nothing of the caller's script
            elastic_launch(config, worker_entry)(*command.args())
    except (KeyboardInterrupt, SignalException):
        raise RunInterruptedError(f"interrupted ({stopper.reason or 'Ctrl-C'}); every "
                                  "worker was stopped at once") from None
    except ChildFailedError as exc:
        stopped = stop_outcome(store, stopper, command.stop_grace)
        if stopped is not None:
            raise stopped from None
        raise WorkerFailedError(failure_message(store, exc.failures, command.logs_dir)
                                ) from None
    finally:
        stopper.uninstall()
        quiet.setLevel(level)
        store.stop()
        os.environ.pop(LAUNCHER_PID_ENV, None)
