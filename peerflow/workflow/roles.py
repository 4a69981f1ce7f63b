"""Roles: the one vocabulary of which engine group runs a workflow node.

A role names a group of engine instances. Its `side` says which config section shapes
its layout (`rollout.layout` or `trainer.layout`) and so where placement puts it; its
`engine` says which registry builds its engine on a rank (none for `reward`, which runs
plain functions); `trainable` roles are saved in checkpoints. What makes one role's engine
differ from another's of the same registry (the critic's value head, the LoRA reference
that views the actor's base, MoE routing replay for the policy alone) is said here too, so
adding a role (a teacher, a reward model) is adding an entry, not a branch in the worker.
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
    value_head: bool = False
    """Its train engine carries a scalar value head (the engine must declare
    `Capabilities.value_head`; its options' `value_head` is switched on)."""
    adapters: Literal["none", "trains", "base_view"] = "none"
    """What `trainer.lora` means for it: `trains` the adapters, `base_view` is the
    adapted engine of the policy (`actor`) with its adapters off, `none` ignores them."""
    routing_replay: bool = False
    """MoE routing replay (`trainer.routing_replay`) applies to it; other roles route
    natively."""


#: Every role, by name.
ROLES: dict[str, Role] = {r.name: r for r in (
    Role(name="rollout", side="rollout", engine="rollout_engine"),
    Role(name="reward", side="rollout", engine=None),
    Role(name="actor", side="trainer", engine="train_engine", trainable=True,
         adapters="trains", routing_replay=True),
    Role(name="ref", side="trainer", engine="train_engine", adapters="base_view"),
    Role(name="critic", side="trainer", engine="train_engine", trainable=True,
         value_head=True),
)}


def trainable_roles() -> tuple[str, ...]:
    """Names of the roles whose engines a checkpoint saves."""
    return tuple(name for name, role in ROLES.items() if role.trainable)


def engine_roles() -> tuple[str, ...]:
    """Names of the roles that need an engine on the ranks hosting them."""
    return tuple(name for name, role in ROLES.items() if role.engine is not None)
