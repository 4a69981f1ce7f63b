"""`RankProgram`: the part of the run plan one worker executes.

The planner (`peerflow.planner.plan_run`) orders the workflow and emits, per rank, a
sequence of ops: `RunNode` (run a workflow node with this rank's engine of its role) and
`RouteOp` (move the batch from one role's layout to another's through the data
coordinator). `program_from_plan` turns that into the steps the worker loop runs and
collects the facts the worker needs at start-up: which roles it hosts, their layouts and
process groups, and which layout's dp-ranks read prompts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from peerflow.batch import Batch
from peerflow.layout import ParallelLayout


@attrs.frozen(kw_only=True)
class RouteStep:
    """A batch redistribution between two layouts (a planner `RouteOp`)."""

    route: Any
    """The planner's `Route` (`src`, `dst` layouts)."""
    group: Any = None
    """Process group of the route's participants (`None`: the default group)."""
    mode: str = "p2p"
    """`p2p` or `centralized` (`runtime.coordinator`)."""
    transport: str = "auto"
    """`auto`, `gloo` or `shm` (`runtime.coordinator_transport`)."""

    @property
    def name(self) -> str:
        """Route name, used for timings and fault stages (`route <name>`)."""
        return f"route {self.route.name}"

    def run(self, batch: Batch, metrics: Any = None, *, shared_prompts: bool = False) -> Batch:
        """Returns this rank's consumer shard of the redistributed batch.

        `shared_prompts`: the consumers run a prompt once for all its samples, so the
        token loads count it once (`redistribute`); every rank of the route passes the
        same value (`consumers_share_prompts`).

        Records into `metrics` (a `StepMetrics`, when given) the busiest rank's CPU
        seconds in the call, `coordinator/<route>/cpu_s`, and bytes sent and received,
        `coordinator/<route>/bytes`: the route's `time/` figure is its slowest rank's
        wall, which includes waiting for the last producer to arrive. A route that
        balances samples (`route.keep_groups` false) also records the consumer
        dp-ranks' token loads before and after it: `balance/tokens_max_before`,
        `balance/tokens_max_after`, `balance/tokens_mean` and `balance/imbalance_before`
        / `_after` (busiest load over the mean; 1 is even).
        """
        from peerflow.coordinator import TransferStats, redistribute

        stats = TransferStats()
        out = redistribute(batch, self.route, self.group, mode=self.mode,
                           transport=self.transport, keep_groups=self.route.keep_groups,
                           shared_prompts=shared_prompts, stats=stats)
        if metrics is not None:
            metrics.max(f"coordinator/{self.route.name}/cpu_s", stats.cpu_s)
            metrics.max(f"coordinator/{self.route.name}/bytes", stats.bytes_total)
        plan = stats.plan
        if metrics is not None and not self.route.keep_groups and plan is not None:
            mean = sum(plan.dst_loads) / max(len(plan.dst_loads), 1)
            peaks = {"after": max(plan.dst_loads, default=0)}
            if plan.src == plan.dst:  # the producer shards are the consumers' loads before
                peaks["before"] = max(plan.src_loads, default=0)
            metrics.max("balance/tokens_mean", mean)
            for when, peak in peaks.items():
                metrics.max(f"balance/tokens_max_{when}", peak)
                metrics.max(f"balance/imbalance_{when}", peak / mean if mean else 1.0)
        return out

    def consumers_share_prompts(self, sharing: Mapping[str, bool]) -> bool:
        """Whether the consumers run a prompt once for all its samples in a row.

        `sharing` is the run's `roles_sharing_prompts`, the same on every rank, so every
        rank of the route decides alike, producer-only ranks included.
        """
        return bool(sharing.get(self.route.dst_role, False))


def roles_sharing_prompts(engines: Mapping[str, Any]) -> dict[str, bool]:
    """Role → whether its engines run a prompt once for all its samples, for every role.

    Collective over the world (call on every rank after building the engines): a route
    balances by what its consumers run (`RouteStep.consumers_share_prompts`), and a rank
    that only produces for it, or an async rollout rank, does not host the consumer's
    engine. A role shares prompts when every rank hosting it says so (its engines'
    `shares_prompts`, which depends on the model as well as the config).
    """
    import torch.distributed as dist

    from peerflow.distributed.comm import all_gather_values

    mine = {role: bool(getattr(engine, "shares_prompts", False))
            for role, engine in engines.items()}
    gathered: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = all_gather_values(mine, what="which roles share prompts")
    sharing: dict[str, bool] = {}
    for facts in gathered:
        for role, shares in facts.items():
            sharing[role] = sharing.get(role, True) and shares
    return sharing


@attrs.frozen(kw_only=True)
class RankProgram:
    """What one rank runs each step, and the role facts it needs to build engines."""

    rank: int
    """Global rank."""
    steps: tuple[Any, ...]
    """Workflow `Node`s and `RouteStep`s, in execution order."""
    layouts: dict[str, ParallelLayout]
    """Layout of every role whose engine this rank hosts."""
    data_layout: ParallelLayout
    """Layout whose dp-ranks read prompt shards (the `generate` node's role)."""
    placement: dict[str, ParallelLayout] = attrs.field(factory=dict)
    """Layout of every role of the run, hosted here or not."""
    groups: dict[str, Any] = attrs.field(factory=dict)
    """torch.distributed group of each hosted role (`None` only without torch.distributed)."""
    phases: dict[str, str] = attrs.field(factory=dict)
    """Async mode: node name → streaming phase (`peerflow.planner.streaming`)."""

    @property
    def roles(self) -> tuple[str, ...]:
        """Roles hosted on this rank."""
        return tuple(self.layouts)

    def process_group(self, role: str) -> Any:
        """Returns the process group of `role`."""
        return self.groups.get(role)

    def nodes(self, phase: str) -> list[Any]:
        """This rank's nodes of one streaming phase, in program order."""
        return [n for n in self.steps if self.phases.get(getattr(n, "name", "")) == phase]

    def has_kind(self, kind: str) -> bool:
        """Whether this rank runs a node of `kind`."""
        return any(getattr(n, "kind", "") == kind for n in self.steps)


def _new_groups(layouts: dict[str, ParallelLayout], world_size: int, timeout: float) -> dict:
    """One group per distinct rank set of a role (the world group for the whole world).

    `new_group` is collective: every rank calls this with the same layouts, in the same
    (sorted) order.
    """
    import torch.distributed as dist

    from peerflow.distributed.groups import new_group

    if not dist.is_initialized():
        return {}
    made: dict[tuple[int, ...], Any] = {tuple(range(world_size)): dist.group.WORLD}
    for role in sorted(layouts):
        ranks = tuple(layouts[role].global_ranks)
        if ranks not in made:
            made[ranks] = new_group(ranks, timeout=timeout)
    return {role: made.get(tuple(lay.global_ranks)) for role, lay in layouts.items()}


def program_from_plan(plan: Any, rank: int, *, mode: str = "p2p", transport: str = "auto",
                      timeout: float = 60.0) -> RankProgram:
    """Builds this rank's `RankProgram` from the planner's `RunPlan`.

    Call on every rank: process groups are created collectively, in the same order.
    """
    from peerflow.coordinator import RouteGroups
    from peerflow.planner import RouteOp

    route_groups = RouteGroups.build(plan, timeout=timeout) if plan.routes else None
    role_groups = _new_groups(plan.roles, plan.world_size, timeout)
    steps: list[Any] = []
    hosted: dict[str, ParallelLayout] = {}
    phases: dict[str, str] = {}
    data_role = None
    for op in plan.program(rank):
        if isinstance(op, RouteOp):
            steps.append(RouteStep(route=op.route, mode=mode, transport=transport,
                                   group=route_groups.get(op.route) if route_groups else None))
            continue
        node = plan.graph.node(op.node)
        steps.append(node)
        phases[node.name] = op.phase
        if data_role is None and node.kind == "generate":
            data_role = node.role
        for role in (node.role, node.options.get("target")):
            if role in plan.roles and rank in plan.roles[role].global_ranks:
                hosted[role] = plan.roles[role]
    data_layout = plan.roles[data_role or "rollout"]
    return RankProgram(rank=rank, steps=tuple(steps), layouts=hosted, data_layout=data_layout,
                       placement=dict(plan.roles),
                       groups={r: role_groups.get(r) for r in hosted}, phases=phases)
