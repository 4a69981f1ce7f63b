"""Process groups for routes, created once, identically, on every rank."""

from __future__ import annotations

from typing import Any

import attrs
import torch.distributed as dist

from peerflow.distributed.groups import new_group


@attrs.define(eq=False)
class RouteGroups:
    """One process group per distinct rank set `src ∪ dst` of a plan's routes.

    `torch.distributed.new_group` must be called by every rank in the same order, so
    `build` walks the plan's routes in plan order on every rank. A route spanning the
    whole world uses the default group.
    """

    groups: dict[tuple[int, ...], Any] = attrs.field(factory=dict)

    @classmethod
    def build(cls, plan: Any, timeout: float | None = None) -> RouteGroups:
        """Creates the groups of every route in `plan` (call on every rank)."""
        world = dist.get_world_size()
        out = cls()
        for route in plan.routes:
            ranks = route.participants
            if len(ranks) == world or ranks in out.groups:
                continue
            out.groups[ranks] = new_group(ranks, timeout=timeout or None)
        return out

    def get(self, route: Any) -> Any:
        """The group of `route` (`None` for the default group)."""
        return self.groups.get(route.participants)
