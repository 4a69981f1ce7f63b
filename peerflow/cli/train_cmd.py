"""`peerflow train CONFIG`: run RL training on this machine or under torchrun / Ray.

    peerflow train CONFIG [--nprocs N] [--run-dir DIR] [--launcher elastic|ray] [--set k=v]
    peerflow train --resume RUN_DIR [--set k=v]          # continue from the last checkpoint
    torchrun --nnodes 2 --nproc-per-node 8 ... -m peerflow train CONFIG --run-dir DIR

The config is read and validated here, before any worker starts. Under `torchrun` (the
environment carries `RANK` and `WORLD_SIZE`) this process *is* a worker; otherwise the
command spawns `--nprocs` workers through torch.distributed's elastic launcher (or Ray
placement groups with `--launcher ray`), each running `peerflow.worker.main.run_worker`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from peerflow.errors import ConfigError, RunInterruptedError, WorkerFailedError
from peerflow.launch.entry import INTERRUPTED_EXIT


def add_parser(subparsers: Any) -> None:
    """Adds the `train` subcommand."""
    parser = subparsers.add_parser(
        "train", help="run RL training (spawns worker processes)",
        description="Run a training run described by a YAML config. Workers are spawned "
        "through torch.distributed's elastic launcher; under torchrun this process is a worker.",
    )
    parser.add_argument("config", nargs="?", help="run config YAML (optional with --resume: "
                        "the run directory's config.yaml is used)")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="worker processes on this machine (default: runtime.nprocs)")
    parser.add_argument("--run-dir", default=None,
                        help="output directory (default: a fresh runs/<config>-<UTC timestamp>)")
    parser.add_argument("--resume", metavar="RUN_DIR", default=None,
                        help="continue the run in RUN_DIR from its newest checkpoint")
    parser.add_argument("--launcher", choices=("elastic", "ray"), default="elastic",
                        help="how workers are started on one machine (default: elastic)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config value (repeatable)")
    parser.set_defaults(func=run)


def resolve_paths(args: argparse.Namespace) -> tuple[str, str | None]:
    """Returns `(config_path, run_dir)`; `run_dir` is `None` when a fresh one is wanted.

    Raises:
        ConfigError: no config is given, or `--resume` names a directory without a run.
    """
    if args.resume:
        run_dir = Path(args.resume)
        if args.run_dir and Path(args.run_dir).resolve() != run_dir.resolve():
            raise ConfigError(
                f"--resume {args.resume!r} and --run-dir {args.run_dir!r} disagree; a resumed "
                "run writes into the directory it resumes, so drop --run-dir."
            )
        saved = run_dir / "config.yaml"
        if args.config is None and not saved.is_file():
            raise ConfigError(
                f"--resume {args.resume!r}: {saved} does not exist; is it a PeerFlow run "
                "directory? Pass the config explicitly: peerflow train CONFIG --resume DIR."
            )
        return str(args.config or saved), str(run_dir)
    if args.config is None:
        raise ConfigError("peerflow train: give a config file, e.g. "
                          "`peerflow train examples/quickstart.yaml`, or --resume RUN_DIR.")
    return args.config, args.run_dir


def check_config(config_path: str, overrides: list[str]) -> Any:
    """Validates the config and opens its model directory and dataset, before launch."""
    from peerflow.config import load_config, validate_config
    from peerflow.launch.preflight import preflight
    from peerflow.plugins import load_plugins

    config = load_config(config_path, overrides)
    pm = load_plugins()
    validate_config(config, pm)
    preflight(config, pm)
    return config


def run(args: argparse.Namespace) -> int:
    """Runs `peerflow train`; returns the exit code."""
    from peerflow.launch import in_distributed_env, launch
    from peerflow.outputs import create_run_dir

    config_path, run_dir = resolve_paths(args)
    if in_distributed_env():  # under torchrun: this process is one worker
        if run_dir is None:
            raise ConfigError(
                "peerflow train under torchrun: pass --run-dir DIR (on shared storage for "
                "several machines) so every rank writes the same run directory."
            )
        return int(launch(config_path=config_path, overrides=list(args.overrides),
                          run_dir=run_dir, resume=args.resume or restart_resume(run_dir),
                          launcher=args.launcher) or 0)
    if args.nprocs is not None and args.nprocs < 1:
        raise ConfigError(f"--nprocs {args.nprocs}: must be at least 1.")
    overrides = list(args.overrides)
    if args.nprocs is not None:
        # Before validation: a split layout may only fit the --nprocs world size.
        overrides.append(f"runtime.nprocs={args.nprocs}")
    config = check_config(config_path, overrides)
    nprocs = config.runtime.nprocs
    run_path = create_run_dir(run_dir, name=Path(config_path).stem)
    print(f"peerflow train: {nprocs} worker(s), run directory {run_path}", flush=True)
    try:
        return int(launch(
            config_path=config_path, overrides=overrides, run_dir=str(run_path),
            resume=args.resume, nprocs=nprocs, launcher=args.launcher,
            fault_timeout=config.runtime.fault_timeout,
        ) or 0)
    except RunInterruptedError as exc:
        print(f"peerflow train: {exc}.\n{resume_hint(run_path)}", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    except WorkerFailedError as exc:
        print(f"error: {exc}\n{resume_hint(run_path)}", file=sys.stderr, flush=True)
        return 1


def restart_resume(run_dir: str) -> str | None:
    """Under `torchrun --max-restarts N` (N > 0), a run directory with checkpoints resumes.

    torchrun restarts every worker of the job after a failure (and after a membership
    change, without counting it), so every agent's workers must take the same decision
    from what they share: the run directory. Returns `run_dir` when torchrun may restart
    (`TORCHELASTIC_MAX_RESTARTS` > 0) and it holds a complete checkpoint, else `None`.
    """
    import os

    from peerflow.worker.checkpoint import latest_checkpoint

    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    found = latest_checkpoint(run_dir) if restarts > 0 else None
    if found is None:
        return None
    print(f"peerflow train: torchrun --max-restarts {restarts} (restart "
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')} of this agent): resuming "
          f"{run_dir} from step {found[0]}", file=sys.stderr, flush=True)
    return run_dir


def resume_hint(run_dir: Path) -> str:
    """Where a stopped run can continue from, and the command that does it."""
    from peerflow.worker.checkpoint import latest_checkpoint

    found = latest_checkpoint(run_dir)
    if found is None:
        return (f"No checkpoint was written yet (run.checkpoint_every), so there is nothing "
                f"to resume in {run_dir}; start a fresh run.")
    step, directory = found
    return (f"The newest complete checkpoint is step {step} ({directory}); continue with:\n"
            f"  peerflow train --resume {run_dir}")
