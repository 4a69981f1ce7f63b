"""The run directory: created once, holding the resolved config and everything else.

Layout (what the other `peerflow.outputs` modules write)::

    RUN_DIR/
        run.lock             held while a run uses the directory (host, pid); see `RunLock`
        config.yaml          the resolved config (defaults filled in, overrides applied)
        fingerprint.json     what a resume must not change (`peerflow.checkpoint.fingerprint`)
        torchrun_job         under torchrun: the job's `--rdzv-id` (a restart of the same job
                             may start again before the first checkpoint)
        metrics.jsonl        one JSON object per logged step (`step` + metrics)
        reward_errors.jsonl  every (reward, sample) failure with its traceback, and
        reward_errors.json   the end-of-run tally of them (`peerflow.outputs.reward_errors`)
        tb/                  TensorBoard events
        trace_rank{r}.json   Chrome-trace timeline of rank r (chrome://tracing, Perfetto)
        checkpoints/         see `peerflow.checkpoint.store`
        report/              PNG plots from `peerflow report RUN_DIR`
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from peerflow.checkpoint.atomic import write_text_atomic
from peerflow.errors import ConfigError

CONFIG_FILE = "config.yaml"
LOCK_FILE = "run.lock"
TORCHRUN_JOB_FILE = "torchrun_job"
"""Where rank 0 under torchrun records its job id (`same_torchrun_job`)."""
DEFAULT_ROOT = "runs"


def create_run_dir(
    run_dir: str | Path | None = None, *, root: str | Path = DEFAULT_ROOT, name: str = "run",
    now: dt.datetime | None = None,
) -> Path:
    """Creates (or reuses) the run directory and returns it.

    Args:
        run_dir: The directory to use; created if missing, reused if it exists.
        root: Parent of a fresh directory when `run_dir` is `None`.
        name: Prefix of a fresh directory's name.
        now: Timestamp of a fresh directory (default: the current UTC time).

    Returns:
        `run_dir`, or a fresh `root/<name>-YYYYmmdd-HHMMSS[-k]` that did not exist before
        (a suffix `-k` keeps two runs started in the same second apart).
    """
    if run_dir is not None:
        path = Path(run_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    for k in range(1000):
        path = root / (f"{name}-{stamp}" + (f"-{k}" if k else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"could not create a fresh run directory under {root}.")


def write_resolved_config(run_dir: str | Path, config: Any) -> Path:
    """Writes the resolved config to `RUN_DIR/config.yaml` (atomically) and returns it.

    A `RunConfig` also records its fingerprint (`fingerprint.json`), which a resume
    checks before loading anything.

    Args:
        run_dir: The run directory.
        config: A `RunConfig`, or plain data (a mapping) already resolved.
    """
    import yaml

    from peerflow.config import dump_config

    if isinstance(config, dict):
        text = yaml.safe_dump(config, sort_keys=False)
    else:
        from peerflow.checkpoint.fingerprint import write_fingerprint

        text = dump_config(config)
        write_fingerprint(run_dir, config)
    return write_text_atomic(Path(run_dir) / CONFIG_FILE, text)


def torchrun_job() -> str:
    """Returns the torchrun job id (`TORCHELASTIC_RUN_ID`, the `--rdzv-id`) of this process.

    Empty when not under torchrun, and for torchrun's default id `none` (which every job
    without `--rdzv-id` shares, so it identifies none).
    """
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if job == "none" else job


def same_torchrun_job(run_dir: Path) -> bool:
    """Whether this torchrun job started `run_dir` (so this is a restart of its workers).

    Rank 0 records `torchrun_job()` in `RUN_DIR/torchrun_job` once the directory is
    accepted (`record_torchrun_job`).
    """
    job = torchrun_job()
    path = run_dir / TORCHRUN_JOB_FILE
    return bool(job) and path.is_file() and path.read_text().strip() == job


def record_torchrun_job(run_dir: Path) -> None:
    """Records this torchrun job's id in `run_dir` (see `same_torchrun_job`)."""
    if job := torchrun_job():
        write_text_atomic(run_dir / TORCHRUN_JOB_FILE, job)


@attrs.define(eq=False)
class RunLock:
    """The exclusive lock of a run directory: `RUN_DIR/run.lock`, naming host and pids.

    Taken before anything is written to the directory and held for the whole run (by the
    `peerflow train` launcher, or rank 0 under torchrun). Every worker on the lock's host
    adds its pid (`register_worker`), so the lock names the launcher and each local
    worker. A lock is stale only when none of those processes lives on this host (a
    launcher killed with SIGKILL leaves workers that exit within a second or two, and
    until then a resume is refused); a stale lock is taken over, saying so, and so is a
    lock of the same torchrun job (`torchrun_job()`: its agents stopped every worker
    before restarting them, on whichever host rank 0 lands); a lock held by a live
    process, or by another host, refuses the run.
    """

    run_dir: Path
    """The run directory."""
    log: Callable[[str], None] = print
    """Where a stale lock's take-over is reported."""
    _held: bool = False

    @property
    def path(self) -> Path:
        """The lock file."""
        return Path(self.run_dir) / LOCK_FILE

    def acquire(self) -> RunLock:
        """Takes the lock (creating it atomically) and returns `self`.

        Raises:
            ConfigError: another live run holds it (its host, pid and start time named).
        """
        mine = {"host": socket.gethostname(), "pid": os.getpid(),
                "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "job": torchrun_job() or None, "workers": []}
        for _ in range(3):
            try:  # O_EXCL: exactly one process creates the file
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as handle:
                    fcntl.flock(handle, fcntl.LOCK_EX)  # readers wait for the content
                    handle.write(json.dumps(mine))
                self._held = True
                return self
            holder = self._holder()
            restarted = holder is not None and mine["job"] and holder.get("job") == mine["job"]
            live = self._live(holder)  # read once: the refusal names what was decided on
            if holder is None or not (restarted or live == []):
                raise self._refusal(holder, live)
            why = (f"torchrun job {mine['job']} restarted its workers" if restarted
                   else "that process no longer exists")
            self.log(f"{self.path}: removing a stale lock of pid {holder['pid']} on "
                     f"{holder['host']} ({why}).")
            self.path.unlink(missing_ok=True)
        raise ConfigError(f"{self.path}: could not take the lock; try again.")

    def release(self) -> None:
        """Removes the lock file if this object holds it."""
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _holder(self) -> dict[str, Any] | None:
        return read_lock(self.path)

    @staticmethod
    def _live(holder: dict[str, Any] | None) -> list[int] | None:
        """The holder's live pids; `None` when they cannot be checked (no holder, other host)."""
        if holder is None or holder.get("host") != socket.gethostname():
            return None
        return live_holders(holder)

    def _refusal(self, holder: dict[str, Any] | None, live: list[int] | None) -> ConfigError:
        who = (f"pid {holder['pid']} on host {holder['host']} (since {holder.get('started')})"
               if holder else "another process")
        if live:  # pids were checked, so there is a holder
            workers = [pid for pid in live if pid != int(holder["pid"])]
            if workers and int(holder["pid"]) not in live:
                who = (f"the workers (pids {', '.join(map(str, workers))}) of a launcher "
                       f"that is gone (pid {holder['pid']} on host {holder['host']}); they "
                       "exit within a few seconds, then retry")
        return ConfigError(
            f"run directory {str(self.run_dir)!r} is in use by {who}: {self.path} is held. "
            "Two runs on one directory would corrupt each other; wait for that run to end, "
            "pick another --run-dir, or, if that process is gone, delete the lock file."
        )


def read_lock(path: Path) -> dict[str, Any] | None:
    """The content of a lock file (read under a shared `flock`), or `None` if unreadable."""
    try:
        with open(path) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            return json.loads(handle.read())
    except (OSError, ValueError):
        return None


def live_holders(holder: dict[str, Any]) -> list[int]:
    """The pids of a lock on this host (launcher and workers) whose processes still live."""
    from peerflow.distributed.procs import process_gone

    pids = [int(holder["pid"]), *(int(p) for p in holder.get("workers") or ())]
    return [pid for pid in pids if not process_gone(pid)]


def register_worker(run_dir: str | Path, pid: int | None = None) -> bool:
    """Adds a worker's pid to `RUN_DIR/run.lock` when the lock is held on this host.

    The file is rewritten in place under an exclusive `flock` (readers take a shared
    one), so concurrent workers never lose each other's pid.

    Returns:
        Whether the pid was recorded (no lock, or one of another host: nothing to do).
    """
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    with os.fdopen(fd, "r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            holder = json.loads(handle.read())
        except ValueError:
            return False
        if holder.get("host") != socket.gethostname():
            return False
        holder["workers"] = [*(holder.get("workers") or ()), pid or os.getpid()]
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(holder))
        handle.flush()
    return True
