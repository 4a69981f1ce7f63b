"""Starting worker processes: elastic launcher, torchrun, or Ray.

Interface for `peerflow train` (`peerflow.cli.train_cmd`):

    launch(config_path=…, overrides=[…], run_dir=…, resume=None, nprocs=N,
           launcher="elastic" | "ray", fault_timeout=config.runtime.fault_timeout)

Three modes (see `docs/launch.md`):

* **one machine** — `launch` spawns `nprocs` workers with
  `torch.distributed.launcher.api.elastic_launch` (the engine behind `torchrun`);
* **several machines** — `torchrun --nnodes … -m peerflow train CONFIG`: the environment
  already describes the job, so `launch` (and `peerflow train`) run the worker in this
  process;
* **Ray** — `launcher="ray"` places one actor per worker in a placement group.

Each worker runs `peerflow.launch.entry.worker_entry`, which initialises
torch.distributed with the fault monitor and calls
`peerflow.worker.main:run_worker(config_path, overrides, run_dir, resume)`. When a worker
dies or raises, every other rank exits within `fault_timeout` naming it, and `launch`
raises `WorkerFailedError` (the CLI exits 1).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from peerflow.errors import ConfigError
from peerflow.launch.entry import DEFAULT_ENTRY, WorkerCommand, resolve_entry, worker_entry

#: Launchers `launch` knows.
LAUNCHERS = ("elastic", "ray")


def in_distributed_env() -> bool:
    """Whether this process was started by torchrun (or another launcher) as a worker."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def launch(
    config_path: str | None,
    overrides: Sequence[str] = (),
    run_dir: str = "runs/peerflow",
    resume: str | None = None,
    nprocs: int | None = None,
    launcher: str = "elastic",
    fault_timeout: float | None = None,
    *,
    entry: str = DEFAULT_ENTRY,
    torch_threads: int | None = None,
    stop_grace: float | None = None,
    wait_timeout: float | None = None,
    checkpoint: str | None = None,
) -> int:
    """Runs the workers of a run and returns 0 when every one finished cleanly.

    Args:
        config_path: Run config YAML.
        overrides: `--set` assignments (also passed to every worker).
        run_dir: Run directory.
        resume: Run directory to resume from.
        nprocs: Worker processes on this machine (default: `runtime.nprocs`).
        launcher: `elastic` or `ray`; ignored under torchrun.
        fault_timeout: Seconds within which all ranks exit after a failure (default:
            `runtime.fault_timeout`).
        entry: `module:function` every worker runs.
        torch_threads: torch threads per worker (default: `runtime.torch_threads`).
        stop_grace: Seconds a graceful stop may take (default: `runtime.stop_grace`).
        wait_timeout: Seconds a rank waits for a live peer (default: with the config read,
            `runtime.peer_wait_timeout`; else `fault_timeout`).
        checkpoint: A checkpoint or run directory the entry only reads (`peerflow eval`),
            given to it in `resume`'s place; nothing is written there.

    Returns:
        0.

    Raises:
        ConfigError: an unknown launcher or a bad process count.
        WorkerFailedError: a worker died or raised (naming its rank, host and stage).
    """
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r}: use one of {', '.join(LAUNCHERS)}.")
    if None in (fault_timeout, nprocs, torch_threads):
        from peerflow.config import load_config

        runtime = load_config(config_path, overrides).runtime
        fault_timeout = runtime.fault_timeout if fault_timeout is None else fault_timeout
        nprocs = runtime.nprocs if nprocs is None else nprocs
        torch_threads = runtime.torch_threads if torch_threads is None else torch_threads
        stop_grace = runtime.stop_grace if stop_grace is None else stop_grace
        wait_timeout = runtime.peer_wait_timeout if wait_timeout is None else wait_timeout
    resolve_entry(entry)  # fail here, not in every worker
    command = WorkerCommand(entry=entry, config_path=config_path, overrides=overrides,
                            run_dir=run_dir, resume=resume, fault_timeout=fault_timeout,
                            torch_threads=torch_threads, wait_timeout=wait_timeout,
                            checkpoint=checkpoint,
                            **({} if stop_grace is None else {"stop_grace": stop_grace}))
    if in_distributed_env():
        worker_entry(*command.args())
        return 0
    if nprocs < 1:
        raise ConfigError(f"nprocs={nprocs}: need at least one worker process.")
    if launcher == "ray":
        from peerflow.launch.ray_launcher import launch_ray

        launch_ray(command, nprocs=nprocs)
    else:
        from peerflow.launch.elastic import launch_elastic

        launch_elastic(command, nprocs=nprocs)
    return 0


__all__ = ["DEFAULT_ENTRY", "LAUNCHERS", "in_distributed_env", "launch", "worker_entry"]
