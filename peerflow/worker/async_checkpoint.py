"""Checkpoints of async runs: engine state plus the in-flight bookkeeping.

Trainer ranks write, every `run.checkpoint_every` steps and at the end,
`checkpoints/step_N/actor/` (the engine's own checkpoint) and `async_state.json`:

    {"step": N, "trained_groups": {"<rollout rank>": [group ids trained so far]}}

Rollout ranks hold no state worth saving: on resume each one replays its prompt stream
(`replay_sampler`) up to its last trained prompt and queues the prompts that were in
flight (admitted, or finished but not yet trained) to be generated again first, so no
prompt is lost and no sample is trained twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peerflow.worker.runtime import WorkerRuntime

ASYNC_STATE = "async_state.json"


def resume_state(rt: WorkerRuntime) -> tuple[int, dict[str, Any] | None]:
    """Returns `(step, async_state)` of the newest complete checkpoint, or `(0, None)`."""
    from peerflow.worker import checkpoint as ckpt

    found = ckpt.latest_checkpoint(rt.run_dir)
    if not found:
        return 0, None
    step, directory = found
    state_path = Path(directory) / ASYNC_STATE
    state = json.loads(state_path.read_text()) if state_path.is_file() else None
    return step, state


def replay_sampler(rt: WorkerRuntime, state: dict[str, Any]) -> list[Any]:
    """Advances the prompt stream past every trained prompt; returns the untrained ones."""
    trained = set(state.get("trained_groups", {}).get(str(rt.rank), []))
    if not trained:
        return []
    holes = []
    top = max(trained)
    while True:
        (draw,) = rt.sampler.draw(1)
        if draw.position not in trained:
            holes.append(draw)
        if draw.position >= top:
            return holes


def save_trainer_checkpoint(
    rt: WorkerRuntime, step: int, trained: dict[int, list[int]], group: Any
) -> None:
    """Saves the actor engine and the in-flight bookkeeping (every trainer rank).

    Args:
        rt: This trainer rank's runtime.
        step: Steps trained so far.
        trained: Rollout rank → group ids trained so far.
        group: The trainer ranks' process group (barriers around the engine save).
    """
    from peerflow.distributed import barrier
    from peerflow.worker import checkpoint as ckpt

    directory = ckpt.checkpoint_dir(rt.run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    barrier(group, what=f"async checkpoint step {step}")
    rt.engine("actor").save_checkpoint(str(directory / "actor"))
    barrier(group, what=f"async checkpoint step {step}")
    if rt.rank == min(rt.layouts["actor"].global_ranks):
        ckpt.write_json_atomic(
            directory / ASYNC_STATE,
            {
                "step": step,
                "trained_groups": {str(k): sorted(set(v)) for k, v in trained.items()},
            },
        )
        ckpt.write_json_atomic(directory / ckpt.COMPLETE, {"step": step})


def load_trainer_checkpoint(rt: WorkerRuntime, step: int) -> None:
    """Restores the actor engine saved at `step`."""
    from peerflow.worker import checkpoint as ckpt

    directory = ckpt.checkpoint_dir(rt.run_dir, step)
    rt.engine("actor").load_checkpoint(str(directory / "actor"))
