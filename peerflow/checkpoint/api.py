"""The checkpoint API the run driver calls, the same in sync and async mode.

Call sequence:

1. At start-up, on **every rank** (a collective over the default group):
   `restore_latest(run_dir, engines=..., rank=...)` — rank 0 picks the newest checkpoint
   that verifies against its manifest (reporting and skipping newer ones that do not),
   every rank learns the choice, loads its trainable engines, and gets back its own
   driver state (sampler cursor; the RNG state is restored here) and the in-flight state.
2. After a step, on **every rank of `group`** (the ranks hosting trainable roles: the
   world in sync mode, the trainer ranks in async mode): `save_step(...)` — every
   trainable role's engine state, each rank's driver state, the optional in-flight
   streaming state, then (leader only, behind a barrier) the manifest, written last,
   and the retention policy (`run.keep_last`).
3. On an interrupt (Ctrl-C) between steps, when every rank of `group` finished the same
   step: `save_step` for it if `newest_complete(run_dir)` is older — as costly as a
   regular save, so only worth it when the last checkpoint is behind.

Layout: see `peerflow.checkpoint.store`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from peerflow.checkpoint.atomic import write_json_atomic
from peerflow.checkpoint.manifest import write_manifest
from peerflow.checkpoint.pickles import UntrustedCheckpointError
from peerflow.checkpoint.state import rng_state, set_rng_state
from peerflow.checkpoint.store import newest_verified, prune, step_dir
from peerflow.errors import ConfigError
from peerflow.workflow.roles import trainable_roles

#: Roles whose engines learn, so a checkpoint must hold their state ("ref" is frozen).
TRAINABLE_ROLES = trainable_roles()
INFLIGHT = "inflight.json"
DRIVER = "driver"


@attrs.frozen(kw_only=True)
class Resumed:
    """What `restore_latest` restored and hands back to the driver."""

    step: int
    """Steps trained before the checkpoint; the run continues with `step + 1`."""
    driver_state: dict[str, Any] | None
    """This rank's saved driver state (`None` for a rank that saved none, e.g. rollout)."""
    inflight: dict[str, Any] | None
    """The in-flight streaming state of an async run (`None` in sync mode)."""


def trainable_engines(engines: Mapping[str, Any]) -> dict[str, Any]:
    """The engines among `engines` (role → engine) a checkpoint saves, sorted by role."""
    return {role: engines[role] for role in sorted(engines) if role in TRAINABLE_ROLES}


def should_checkpoint(step: int, every: int, total_steps: int) -> bool:
    """Whether to save after `step`: every `every` steps (0: never) and after the last."""
    return step == total_steps or (every > 0 and step % every == 0)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _leader(group: Any) -> int:
    import torch.distributed as dist

    if group is None or not _distributed():
        return 0
    return min(dist.get_process_group_ranks(group))


def _barrier(group: Any, what: str) -> None:
    if _distributed():
        from peerflow.distributed import barrier

        barrier(group, what=what)


def save_step(
    run_dir: str | Path,
    step: int,
    *,
    engines: Mapping[str, Any],
    rank: int,
    driver_state: Mapping[str, Any] | None = None,
    inflight: Mapping[str, Any] | None = None,
    group: Any = None,
    keep_last: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """Saves a checkpoint of `step` (call on every rank of `group`).

    Args:
        run_dir: The run directory.
        step: Steps trained so far.
        engines: This rank's engines by role; the trainable ones are saved.
        rank: This process's global rank.
        driver_state: JSON-able state of this rank's driver (e.g. the sampler cursor).
        inflight: JSON-able in-flight streaming state, written once by the leader.
        group: The process group of the saving ranks (`None`: the world).
        keep_last: Keep only the newest `keep_last` checkpoints (0: keep all).
        log: Where the leader reports pruned checkpoints.

    Returns:
        The checkpoint's directory.
    """
    directory = step_dir(run_dir, step)
    leader = rank == _leader(group)
    if leader:  # a stale directory of this step (from before a resume) must go first
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    _barrier(group, f"checkpoint step {step}")
    for role, engine in trainable_engines(engines).items():
        engine.save_checkpoint(str(directory / role))
    write_json_atomic(directory / DRIVER / f"rank{rank}.json",
                      {"step": step, "rng": rng_state(), **(driver_state or {})})
    if leader and inflight is not None:
        write_json_atomic(directory / INFLIGHT, {"step": step, **inflight})
    _barrier(group, f"checkpoint step {step}")
    if leader:
        write_manifest(directory, step=step)
        for path in prune(run_dir, keep_last):
            log(f"checkpoint {path} removed (run.keep_last={keep_last})")
    return directory


def _agreed_step(run_dir: str | Path, rank: int, report: Callable[[str], None]) -> int | None:
    """Rank 0 verifies the checkpoints; every rank gets its choice, or its refusal."""
    choice: list[Any] = [None, None]  # step, refusal
    if rank == 0:
        try:
            chosen = newest_verified(run_dir, report)
            choice[0] = chosen.step if chosen is not None else None
        except UntrustedCheckpointError as exc:
            choice[1] = str(exc)
    if _distributed():
        import torch.distributed as dist

        if dist.get_world_size() > 1:  # rank 0's choice, decoded without pickle
            from peerflow.distributed.comm import all_gather_values

            choice = all_gather_values(choice, what="checkpoint choice")[0]
    if choice[1] is not None:
        raise UntrustedCheckpointError(choice[1])
    return choice[0]


def restore_latest(
    run_dir: str | Path,
    *,
    engines: Mapping[str, Any],
    rank: int,
    report: Callable[[str], None] = print,
) -> Resumed | None:
    """Restores the newest verified checkpoint (call on every rank, at start-up).

    Args:
        run_dir: The run directory.
        engines: This rank's engines by role; the trainable ones are loaded.
        rank: This process's global rank.
        report: Where rank 0 reports checkpoints that fail verification.

    Returns:
        What was restored, or `None` when the run directory holds no verified checkpoint.

    Raises:
        ConfigError: the checkpoint lacks the state of a role this run trains.
        UntrustedCheckpointError: the newest checkpoint holds a pickle the safe loader
            refuses and `--trust-checkpoint` was not given (every rank raises it).
    """
    step = _agreed_step(run_dir, rank, report)
    if step is None:
        return None
    directory = step_dir(run_dir, step)
    for role, engine in trainable_engines(engines).items():
        if not (directory / role).is_dir():
            raise ConfigError(
                f"checkpoint {directory} holds no state of role {role!r} (it has "
                f"{sorted(p.name for p in directory.iterdir() if p.is_dir())}); the run that "
                "wrote it trained other roles. Resume with that run's workflow."
            )
        engine.load_checkpoint(str(directory / role))
    own = directory / DRIVER / f"rank{rank}.json"
    driver_state = json.loads(own.read_text()) if own.is_file() else None
    if driver_state is not None:
        set_rng_state(driver_state["rng"])
    inflight_path = directory / INFLIGHT
    inflight = json.loads(inflight_path.read_text()) if inflight_path.is_file() else None
    return Resumed(step=step, driver_state=driver_state, inflight=inflight)
