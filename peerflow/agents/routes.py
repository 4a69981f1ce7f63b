"""The experts a mixture-of-experts model routed a multi-turn trajectory's tokens to.

Each model turn's request is the whole sequence so far, so the engine's `routed_experts`
cover it all; a trajectory keeps the prompt's routes from its first turn and, from every
turn, the routes of the tokens the model sampled in it (the turn's last sampled token is
never fed: -1). Observation tokens (tools, environment) get -1 rows: no route, as the
routes field defines (`peerflow.routes`). The trajectory's routes then cover its prompt
and every response token, like the token ids, and pack into the batch's `routed_experts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from peerflow.ragged import RaggedField


def add_turn_routes(trajectory: Any, routes: torch.Tensor | None, sampled: int) -> None:
    """Keeps a model turn's routes; call before the turn's tokens are appended.

    Args:
        trajectory: The `Trajectory` (its `prompt`, `tokens` and `routes` list).
        routes: The turn result's `routed_experts` (over the request: prompt + tokens so
            far + this turn's tokens), or `None` from an engine without routes.
        sampled: How many of the turn's tokens the trajectory keeps.
    """
    if routes is None:
        trajectory.routes.append(sampled)
        return
    if not trajectory.routes and not trajectory.tokens:
        trajectory.routes.append(routes[: len(trajectory.prompt)])
    start = len(trajectory.prompt) + len(trajectory.tokens)
    trajectory.routes.append(routes[start: start + sampled])


def add_observation_routes(trajectory: Any, count: int) -> None:
    """Observation tokens have no route (-1 rows)."""
    trajectory.routes.append(count)


def pack_routes(trajectories: Sequence[Any]) -> RaggedField | None:
    """The `routed_experts` field of finished trajectories, or `None` without routes.

    A trajectory without any route (its engine returned none) gets -1 rows.
    """
    first = next((r for t in trajectories for r in t.routes if isinstance(r, torch.Tensor)),
                 None)
    if first is None:
        return None
    trailing = tuple(first.shape[1:])
    rows = []
    for t in trajectories:
        parts = [r if isinstance(r, torch.Tensor) else torch.full((r, *trailing), -1,
                                                                  dtype=torch.int16)
                 for r in t.routes]
        if not any(isinstance(r, torch.Tensor) for r in t.routes):
            parts.insert(0, torch.full((len(t.prompt), *trailing), -1, dtype=torch.int16))
        row = torch.cat(parts) if parts else torch.empty((0, *trailing), dtype=torch.int16)
        tokens = len(t.prompt) + len(t.tokens)
        if len(row) != tokens:
            raise ValueError(f"trajectory routes cover {len(row)} tokens but it has {tokens} "
                             "(prompt + response); an engine returned routes of another length.")
        rows.append(row.to(torch.int16))
    return RaggedField.from_tensors(rows, dtype=torch.int16)
