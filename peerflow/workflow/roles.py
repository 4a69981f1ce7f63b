"""Roles: the one vocabulary of which engine group runs a workflow node.

A role names a group of engine instances. Its `side` says which config section shapes
its layout (`rollout.layout` or `trainer.layout`) and so where placement puts it; its
`engine` says which registry builds its engine on a rank (none for `reward`, which runs
plain functions); `trainable` roles are saved in checkpoints.
"""

from __future__ import annotations

from typing import Literal

import attrs


@attrs.frozen(kw_only=True)
class Role:
    """One role a workflow node may name."""

    name: str
    side: Literal["rollout", "trainer"]
    """Config section (`rollout` or `trainer`) whose layout the role takes."""
    engine: Literal["rollout_engine", "train_engine"] | None
    """Registry kind of the role's engine; `None`: the role needs no engine."""
    trainable: bool = False
    """Its engine's weights and optimiser change (saved in checkpoints)."""


#: Every role, by name.
ROLES: dict[str, Role] = {r.name: r for r in (
    Role(name="rollout", side="rollout", engine="rollout_engine"),
    Role(name="reward", side="rollout", engine=None),
    Role(name="actor", side="trainer", engine="train_engine", trainable=True),
    Role(name="ref", side="trainer", engine="train_engine"),
    Role(name="critic", side="trainer", engine="train_engine", trainable=True),
)}


def trainable_roles() -> tuple[str, ...]:
    """Names of the roles whose engines a checkpoint saves."""
    return tuple(name for name, role in ROLES.items() if role.trainable)


def engine_roles() -> tuple[str, ...]:
    """Names of the roles that need an engine on the ranks hosting them."""
    return tuple(name for name, role in ROLES.items() if role.engine is not None)
