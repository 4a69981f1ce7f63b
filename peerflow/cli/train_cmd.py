"""`peerflow train CONFIG`: run RL training on this machine or under torchrun / Ray.

    peerflow train CONFIG [--nprocs N] [--run-dir DIR] [--launcher elastic|ray] [--set k=v]
    peerflow train --resume RUN_DIR [--set k=v] [--allow-change KEY]   # continue a run
    peerflow train --resume RUN_DIR --trust-checkpoint   # pickles you wrote yourself
    torchrun --nnodes 2 --nproc-per-node 8 ... -m peerflow train CONFIG --run-dir DIR

The config is read and validated here, before any worker starts. Under `torchrun` (the
environment carries `RANK` and `WORLD_SIZE`) this process *is* a worker; otherwise the
command spawns `--nprocs` workers through torch.distributed's elastic launcher (or Ray
placement groups with `--launcher ray`), each running `peerflow.worker.main.run_worker`.

Before anything is written, the run directory's lock (`RUN_DIR/run.lock`) is taken, a
fresh run refuses a directory that already holds one, and a resume refuses a config that
differs from the run's fingerprint (`peerflow.checkpoint.fingerprint`) — so a refused
command leaves the directory as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import attrs

from peerflow.cli.options import (
    add_override_argument,
    add_trust_checkpoint_argument,
    add_worker_arguments,
    apply_trust,
)
from peerflow.errors import (
    INTERRUPTED_EXIT,
    ConfigError,
    RunInterruptedError,
    WorkerFailedError,
)

HELP = "run RL training (spawns worker processes)"
DESCRIPTION = ("Run a training run described by a YAML config. Workers are spawned through "
               "torch.distributed's elastic launcher; under torchrun this process is a worker.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds CONFIG, worker options, `--run-dir`, `--resume`, `--allow-change`, `--set` etc."""
    parser.add_argument("config", nargs="?", help="run config YAML (optional with --resume: "
                        "the run directory's config.yaml is used)")
    add_worker_arguments(parser)
    parser.add_argument("--run-dir", default=None,
                        help="output directory (default: a fresh runs/<config>-<UTC timestamp>)")
    parser.add_argument("--resume", metavar="RUN_DIR", default=None,
                        help="continue the run in RUN_DIR from its newest verified checkpoint")
    parser.add_argument("--allow-change", dest="allow_change", action="append", default=[],
                        metavar="KEY", help="with --resume: let this fingerprinted setting or "
                        "section (e.g. algorithm.kl.coef) differ from the run's (repeatable; "
                        "never the model architecture, dtype or tokenizer)")
    add_trust_checkpoint_argument(parser)
    add_override_argument(parser)


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


@attrs.frozen(kw_only=True)
class RunPlan:
    """What `peerflow train` does with a run directory that passed `check_run_dir`."""

    resume: str | None
    """The directory the workers resume from (`None`: they start at step 0)."""
    done_at: int | None = None
    """The newest checkpoint's step when it already reaches `run.steps` (nothing to run)."""


def check_run_dir(
    run_dir: Path, config: Any, *, resume: bool, allow_change: list[str],
    restarted: bool = False,
) -> RunPlan:
    """Refuses a fresh run into a used directory, or a resume that changes the fingerprint.

    A resume of a run that stopped before its first checkpoint starts it again from step
    0 in place (same fingerprint required; unfinished checkpoint directories removed), so
    `peerflow train --resume RUN_DIR` is the one command that retries any run. A resume
    whose newest verified checkpoint already reaches `run.steps` has nothing to do
    (`done_at`).

    Args:
        run_dir: The run directory (locked by the caller).
        config: The validated `RunConfig` about to run.
        resume: Whether the run continues `run_dir` (`--resume`, or a torchrun restart).
        allow_change: `--allow-change` keys.
        restarted: torchrun restarted the job that started this directory
            (`same_torchrun_job`); with no checkpoint yet, the run starts again from step 0
            (same fingerprint required) instead of being refused as a used directory.

    Raises:
        ConfigError: naming the directory, or each differing key with both values.
    """
    from peerflow.checkpoint import newest_complete, newest_verified
    from peerflow.checkpoint.fingerprint import check_resume

    found = newest_complete(run_dir)
    if resume:
        check_resume(run_dir, config, allow_change)
        if found is None:
            _restart_in_place(run_dir, "--resume: the run stopped before its first checkpoint")
            return RunPlan(resume=None)
        if config.run.steps <= found.step:
            # nothing to run only if that checkpoint loads: a newest one that fails
            # verification is skipped by the workers, who say so and train on from an older
            done = newest_verified(run_dir, report=lambda _: None)
            if done is not None and config.run.steps <= done.step:
                return RunPlan(resume=str(run_dir), done_at=done.step)
        return RunPlan(resume=str(run_dir))
    if allow_change:
        raise ConfigError("--allow-change only applies to --resume RUN_DIR; drop it.")
    if restarted and (run_dir / "config.yaml").is_file():
        check_resume(run_dir, config, [])
        _restart_in_place(run_dir, "torchrun restarted the job before its first checkpoint")
    elif (run_dir / "config.yaml").is_file():
        what = ("already holds a run (config.yaml); continue it" if found is not None else
                "holds a run that stopped before its first checkpoint; start it again from "
                "step 0 in place")
        raise ConfigError(f"run directory {str(run_dir)!r} {what} with `peerflow train "
                          f"--resume {run_dir}`, or pick another --run-dir.")
    return RunPlan(resume=None)


def _restart_in_place(run_dir: Path, why: str) -> None:
    """Removes unfinished checkpoint directories and says the run starts again at step 0."""
    import shutil

    from peerflow.checkpoint.store import list_checkpoints

    for info in list_checkpoints(run_dir):  # none has a manifest: none can be loaded
        shutil.rmtree(info.path, ignore_errors=True)
    print(f"peerflow train: {why}: starting {run_dir} again from step 0 with its own "
          "settings", file=sys.stderr, flush=True)


def already_done(run_dir: Path, step: int, steps: int) -> str:
    """The message of a resume with nothing to run, and how to train further."""
    return (f"peerflow train: {run_dir} is already at step {step} (run.steps={steps}); "
            f"nothing to do. To train further, raise run.steps: `peerflow train --resume "
            f"{run_dir} --set run.steps={max(step, steps) + step}`.")


def _torchrun_worker(args: argparse.Namespace, config_path: str, run_dir: str | None) -> int:
    from peerflow.checkpoint import newest_complete
    from peerflow.launch import launch
    from peerflow.launch.preflight import check_config
    from peerflow.outputs.rundir import RunLock, record_torchrun_job, same_torchrun_job

    if run_dir is None:
        raise ConfigError(
            "peerflow train under torchrun: pass --run-dir DIR (on shared storage for "
            "several machines) so every rank writes the same run directory."
        )
    resume = args.resume or restart_resume(run_dir)
    if resume and newest_complete(run_dir) is None:  # every rank decides the same
        resume = None  # stopped before its first checkpoint: rank 0 restarts it in place
    lead = os.environ.get("RANK") == "0"  # one lock per run: rank 0 takes it and checks
    if lead:
        config = check_config(config_path, list(args.overrides))
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    with RunLock(Path(run_dir)) if lead else contextlib.nullcontext():
        if lead:
            check_run_dir(Path(run_dir), config, resume=bool(args.resume or resume),
                          allow_change=args.allow_change,
                          restarted=same_torchrun_job(Path(run_dir)))
            record_torchrun_job(Path(run_dir))
        try:
            return int(launch(config_path=config_path, overrides=list(args.overrides),
                              run_dir=run_dir, resume=resume, launcher=args.launcher) or 0)
        except SystemExit as exc:  # a graceful stop (Ctrl-C): rank 0 says how to go on
            if lead and exc.code == INTERRUPTED_EXIT:
                print(f"peerflow train: stopped.\n{resume_hint(Path(run_dir))}",
                      file=sys.stderr, flush=True)
            raise


def restart_resume(run_dir: str) -> str | None:
    """Under `torchrun --max-restarts N` (N > 0), a run directory with checkpoints resumes.

    torchrun restarts every worker of the job after a failure (and after a membership
    change, without counting it), so every agent's workers must take the same decision
    from what they share: the run directory. Returns `run_dir` when torchrun may restart
    (`TORCHELASTIC_MAX_RESTARTS` > 0) and it holds a complete checkpoint, else `None`.
    """
    from peerflow.checkpoint import newest_complete

    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    found = newest_complete(run_dir) if restarts > 0 else None
    if found is None:
        return None
    print(f"peerflow train: torchrun --max-restarts {restarts} (restart "
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')} of this agent): resuming "
          f"{run_dir} from step {found.step}", file=sys.stderr, flush=True)
    return run_dir


def resume_hint(run_dir: Path) -> str:
    """Where a stopped run can continue from, and the command that does it."""
    from peerflow.checkpoint import newest_complete

    found = newest_complete(run_dir)
    if found is None:
        return (f"No checkpoint was written yet (run.checkpoint_every); start the run again "
                f"from step 0 in place with:\n  peerflow train --resume {run_dir}")
    return (f"The newest complete checkpoint is step {found.step} ({found.path}); continue "
            f"with:\n  peerflow train --resume {run_dir}")


def run(args: argparse.Namespace) -> int:
    """Runs `peerflow train`; returns the exit code.

    Nothing is started before the config, the directory and the resume checks pass: the
    warm fork server starts in `launch`, so a refused command returns in the time the
    checks take and leaves no process holding the caller's stdout.
    """
    from peerflow.launch import in_distributed_env, launch
    from peerflow.launch.preflight import check_config
    from peerflow.outputs import RunLock, create_run_dir

    config_path, run_dir = resolve_paths(args)
    apply_trust(args)
    if in_distributed_env():  # under torchrun: this process is one worker
        return _torchrun_worker(args, config_path, run_dir)
    if args.nprocs is not None and args.nprocs < 1:
        raise ConfigError(f"--nprocs {args.nprocs}: must be at least 1.")
    from peerflow.config.extras import launcher_problem

    if (problem := launcher_problem(args.launcher)) is not None:  # before any process
        raise ConfigError(problem)
    overrides = list(args.overrides)
    if args.nprocs is not None:
        # Before validation: a split layout may only fit the --nprocs world size.
        overrides.append(f"runtime.nprocs={args.nprocs}")
    config = check_config(config_path, overrides)
    nprocs = config.runtime.nprocs
    run_path = create_run_dir(run_dir, name=Path(config_path).stem)
    with RunLock(run_path):
        plan = check_run_dir(run_path, config, resume=bool(args.resume),
                             allow_change=args.allow_change)
        if plan.done_at is not None:  # no worker needed
            print(already_done(run_path, plan.done_at, config.run.steps), flush=True)
            return 0
        print(f"peerflow train: {nprocs} worker(s), run directory {run_path}", flush=True)
        try:
            return int(launch(
                config_path=config_path, overrides=overrides, run_dir=str(run_path),
                resume=plan.resume, nprocs=nprocs, launcher=args.launcher,
                fault_timeout=config.runtime.fault_timeout,
                wait_timeout=config.runtime.peer_wait_timeout,
                stop_grace=config.runtime.stop_grace,
            ) or 0)
        except RunInterruptedError as exc:
            print(f"peerflow train: {exc}.\n{resume_hint(run_path)}", file=sys.stderr,
                  flush=True)
            return INTERRUPTED_EXIT
        except WorkerFailedError as exc:
            print(f"error: {exc}\n{resume_hint(run_path)}", file=sys.stderr, flush=True)
            return 1
