"""In-flight state of an async run: which prompt groups each rollout rank has had trained.

The trainer's leader saves it with every checkpoint (`inflight.json`):

    {"step": N, "trained_groups": {"<rollout rank>": [prompt positions trained so far]}}

Rollout ranks hold no state worth saving: on resume each one replays its prompt stream
up to its last trained prompt (`replay_prompts`) and queues the prompts that were in
flight (admitted, or finished but not yet trained) to be generated again first, so no
prompt is lost and no sample is trained twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def trained_groups_state(trained: Mapping[int, list[int]]) -> dict[str, Any]:
    """Returns the JSON-able in-flight state for `trained` (rollout rank → positions)."""
    return {"trained_groups": {str(k): sorted(set(v)) for k, v in trained.items()}}


def trained_groups(inflight: Mapping[str, Any] | None) -> dict[int, list[int]]:
    """Reads `trained_groups_state` output back (empty for a fresh run)."""
    saved = (inflight or {}).get("trained_groups", {})
    return {int(k): list(v) for k, v in saved.items()}


def replay_prompts(sampler: Any, trained: list[int]) -> list[Any]:
    """Advances `sampler` past every trained prompt; returns the untrained ones it drew.

    Args:
        sampler: This rollout rank's prompt sampler (its `draw(1)` yields `Draw`s).
        trained: The prompt positions of this rank that were trained.
    """
    done = set(trained)
    if not done:
        return []
    holes = []
    top = max(done)
    while True:
        (draw,) = sampler.draw(1)
        if draw.position not in done:
            holes.append(draw)
        if draw.position >= top:
            return holes
