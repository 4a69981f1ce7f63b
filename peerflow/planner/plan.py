"""`plan_run`: the whole run as one program per rank, computed without starting anything.

1. build and check the workflow graph (`peerflow.workflow.build_graph`);
2. place the roles (`place_roles`);
3. walk the nodes in topological order, tracking on which layout the step's batch lives;
   before a node whose role lives on another layout, emit a `RouteOp` that moves the
   batch there (one `Route` per layout change; equal layouts move nothing);
   prompt groups stay whole up to the `advantage` node (group statistics need them);
   after it, with `runtime.balance_samples`, samples are balanced one by one by token
   count over the trainer's dp-ranks — by the next route, or by a `Route` from the
   layout to itself (`keep_groups=False`) when the batch stays there;
4. `RunPlan.program(rank)` keeps the ops a rank takes part in: `RunNode` where the rank
   hosts the node's role, `RouteOp` where it is in `route.src ∪ route.dst`.

That is the lockstep (sync) program. With `runtime.mode: async` step 3 instead gives every
node its streaming phase (`peerflow.planner.streaming`): no routes, the sample stream
moves the batch from rollout to trainer ranks.

Every rank runs the same `plan_run` and so agrees on the programs and routes. A step's
batch starts on the first data node's layout (each dp-rank reads its dataset shard).
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.planner.placement import place_roles
from peerflow.workflow.build import build_graph
from peerflow.workflow.graph import WorkflowGraph


@attrs.frozen(kw_only=True)
class Route:
    """A batch move between two layouts (a redistribution plan, sizes decided at run time)."""

    name: str
    """`src_role->dst_role@node`: where the move happens."""
    src: ParallelLayout
    """Producer layout (where the batch is)."""
    dst: ParallelLayout
    """Consumer layout (where the next node needs it)."""
    src_role: str
    dst_role: str
    edges: tuple[str, ...] = ()
    """Graph edges (`producer->consumer`) whose fields this move carries."""
    fields: tuple[str, ...] = ()
    """Fields present in the batch at that point (every field travels; unknown ones too)."""
    keep_groups: bool = True
    """Keep prompt groups whole (`False`: balance single samples; it then also runs when
    `src == dst`, a re-balance over one layout's dp-ranks)."""

    @property
    def participants(self) -> tuple[int, ...]:
        """Sorted global ranks of `src ∪ dst` (every one calls `redistribute`)."""
        return tuple(sorted(set(self.src.global_ranks) | set(self.dst.global_ranks)))

    @property
    def moves(self) -> bool:
        """Whether samples may move (the layouts differ, or samples are re-balanced)."""
        return self.src != self.dst or not self.keep_groups

    def describe(self) -> str:
        """One line: layouts, senders and receivers."""
        unit = "groups kept whole" if self.keep_groups else (
            "samples (groups may split; whole groups weighed by their rows when the "
            "trainer shares prompts)")
        return (f"{self.name}: {self.src.describe()} -> {self.dst.describe()}; "
                f"{self.src.dp} producer dp-shards to {self.dst.dp} consumer dp-ranks, "
                f"{unit}, token-balanced; fields {', '.join(self.fields)}")


@attrs.frozen(kw_only=True)
class RunNode:
    """Program op: run node `node` (of `kind`, on `role`'s engines) on this rank."""

    node: str
    kind: str
    role: str
    ranks: tuple[int, ...]
    """Global ranks that run it."""
    phase: str = ""
    """Async mode: the streaming phase (`peerflow.planner.streaming`); "" in sync."""

    def describe(self) -> str:
        """Short text form."""
        phase = f", {self.phase.replace('_', ' ')}" if self.phase else ""
        return f"run {self.node} ({self.kind} on {self.role}{phase})"


@attrs.frozen(kw_only=True)
class RouteOp:
    """Program op: take part in moving the batch along `route`."""

    route: Route

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks that take part."""
        return self.route.participants

    def describe(self) -> str:
        """Short text form."""
        return f"route {self.route.name}"


Op = RunNode | RouteOp


def _ranges(ranks: list[int] | tuple[int, ...]) -> str:
    out, start, prev = [], None, None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)


@attrs.frozen(kw_only=True)
class RunPlan:
    """The planned run: role layouts, routes, and the step program of every rank."""

    world_size: int
    placement: str
    coordinator: str
    mode: str = "sync"
    """`sync` (lockstep program) or `async` (streaming phases)."""
    graph: WorkflowGraph
    roles: dict[str, ParallelLayout]
    ops: tuple[Op, ...]
    """The global step program; each rank runs the ops it takes part in, in this order."""
    samples_per_step: int = 0

    @property
    def routes(self) -> tuple[Route, ...]:
        """Every route, in program order."""
        return tuple(op.route for op in self.ops if isinstance(op, RouteOp))

    def program(self, rank: int) -> tuple[Op, ...]:
        """The ordered ops of `rank`'s step.

        Raises:
            ValueError: `rank` is outside the world.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks.")
        return tuple(op for op in self.ops if rank in op.ranks)

    def programs(self) -> list[tuple[tuple[int, ...], tuple[Op, ...]]]:
        """Distinct programs with the ranks that run each (compact at large world sizes)."""
        membership: dict[int, list[int]] = {r: [] for r in range(self.world_size)}
        for i, op in enumerate(self.ops):
            for r in op.ranks:
                membership[r].append(i)
        grouped: dict[tuple[int, ...], list[int]] = {}
        for r, ids in membership.items():
            grouped.setdefault(tuple(ids), []).append(r)
        return [(tuple(ranks), tuple(self.ops[i] for i in ids)) for ids, ranks in grouped.items()]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `peerflow plan --format json`."""
        return {
            "world_size": self.world_size,
            "mode": self.mode,
            "placement": self.placement,
            "coordinator": self.coordinator,
            "samples_per_step": self.samples_per_step,
            "graph": self.graph.to_dict(),
            "roles": {role: {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep,
                             "ranks": _ranges(lay.global_ranks), "describe": lay.describe()}
                      for role, lay in self.roles.items()},
            "routes": [{"name": r.name, "src": r.src.describe(), "dst": r.dst.describe(),
                        "src_role": r.src_role, "dst_role": r.dst_role,
                        "keep_groups": r.keep_groups,
                        "edges": list(r.edges), "fields": list(r.fields),
                        "participants": _ranges(r.participants)} for r in self.routes],
            "edges": self.edge_routes(),
            "programs": [{"ranks": _ranges(ranks), "ops": [op.describe() for op in ops]}
                         for ranks, ops in self.programs()],
        }

    def edge_routes(self) -> list[dict[str, Any]]:
        """Every data edge of the graph, with the layouts at both ends and how it travels."""
        carried: dict[str, str] = {}
        for route in self.routes:
            for edge in route.edges:
                carried[edge] = route.name
        out = []
        for edge in self.graph.edges:
            if not edge.fields:
                continue
            src = self.roles[self.graph.node(edge.producer).role]
            dst = self.roles[self.graph.node(edge.consumer).role]
            local = "sample stream" if self.mode == "async" and src != dst else "local"
            out.append({"edge": edge.name, "fields": list(edge.fields),
                        "src": src.describe(), "dst": dst.describe(),
                        "route": carried.get(edge.name, f"{local} (same layout)"
                                             if local == "local" else local)})
        return out

    def to_text(self) -> str:
        """Human-readable plan (`peerflow plan --format text`)."""
        lines = [f"world size {self.world_size}, {self.mode} mode, placement "
                 f"{self.placement}, coordinator {self.coordinator}, "
                 f"{self.samples_per_step} samples per step",
                 "", "roles:"]
        lines += [f"  {role:8s} {lay.describe()}" for role, lay in self.roles.items()]
        lines += ["", "nodes (in order):"]
        for name in self.graph.order():
            n = self.graph.node(name)
            lines.append(f"  {name:14s} {n.kind:12s} on {n.role:8s} reads "
                         f"[{', '.join(n.inputs)}] writes [{', '.join(n.outputs)}]")
        lines += ["", "data edges:"]
        lines += [f"  {e['edge']:28s} [{', '.join(e['fields'])}] {e['src']} -> {e['dst']}: "
                  f"{e['route']}" for e in self.edge_routes()]
        lines += ["", "routes:"] + ([f"  {r.describe()}" for r in self.routes] or ["  none"])
        lines += ["", "programs:"]
        for ranks, ops in self.programs():
            lines.append(f"  ranks {_ranges(ranks)}: "
                         + (" ; ".join(op.describe() for op in ops) or "(idle)"))
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz source of the graph, nodes labelled with their role's layout."""
        lines = ["digraph peerflow {", "  rankdir=LR;"]
        for name in self.graph.order():
            n = self.graph.node(name)
            label = f"{name}\\n{n.kind} on {n.role}\\n{self.roles[n.role].describe()}"
            lines.append(f'  "{name}" [shape=box, label="{label}"];')
        routes = {e: r.name for r in self.routes for e in r.edges}
        for edge in self.graph.edges:
            label = ", ".join(edge.fields) or "after"
            style = ", style=dashed" if not edge.fields else ""
            color = ", color=red" if edge.name in routes else ""
            lines.append(f'  "{edge.producer}" -> "{edge.consumer}" '
                         f'[label="{label}"{style}{color}];')
        lines.append("}")
        return "\n".join(lines)


def plan_run(config: Any, world_size: int, pm: Any = None,
             graph: WorkflowGraph | None = None) -> RunPlan:
    """Plans a run on `world_size` ranks (pure; starts nothing).

    Args:
        config: The `RunConfig`.
        world_size: Number of worker processes.
        pm: Plugin manager, for plugin node types (`None`: built-in kinds only).
        graph: A graph to plan instead of the config's.

    Returns:
        The `RunPlan`.

    Raises:
        ConfigError: the graph or the layouts are invalid.
    """
    graph = graph or build_graph(config, pm)
    roles = place_roles(config, world_size)
    if config.runtime.mode == "async":
        ops = _streaming_ops(config, graph, roles, pm)
    else:
        ops = _lockstep_ops(graph, roles, balance=config.runtime.balance_samples)
    samples = config.run.prompts_per_step * config.rollout.sampling.n
    return RunPlan(world_size=world_size, placement=config.runtime.placement,
                   mode=config.runtime.mode,
                   coordinator=config.runtime.coordinator, graph=graph, roles=roles,
                   ops=tuple(ops), samples_per_step=samples)


def _ranks(node: Any, roles: dict[str, ParallelLayout]) -> tuple[int, ...]:
    """Ranks running `node`: its role's, plus its `target` role's (`sync_weights`)."""
    ranks = set(roles[node.role].global_ranks)
    target = node.options.get("target")
    if target in roles:
        ranks |= set(roles[target].global_ranks)
    return tuple(sorted(ranks))


def _streaming_ops(config: Any, graph: WorkflowGraph, roles: dict[str, ParallelLayout],
                   pm: Any) -> tuple[Op, ...]:
    """The async program: every node with its streaming phase, no routes."""
    from peerflow.planner.streaming import check_async_config, node_phase
    from peerflow.workflow.build import node_kinds

    check_async_config(config, roles, pm)
    if set(roles["rollout"].global_ranks) & set(roles["actor"].global_ranks):
        raise ConfigError("runtime.mode=async: rollout and actor ranks overlap; "
                          "use split placement.")
    kinds = node_kinds(pm)
    return tuple(RunNode(node=name, kind=graph.node(name).kind, role=graph.node(name).role,
                         ranks=_ranks(graph.node(name), roles),
                         phase=node_phase(graph.node(name), kinds, roles))
                 for name in graph.order())


def _lockstep_ops(graph: WorkflowGraph, roles: dict[str, ParallelLayout], *,
                  balance: bool = False) -> tuple[Op, ...]:
    """The sync program: nodes in order, a `RouteOp` wherever the batch changes layout.

    With `balance`, routes after the `advantage` node balance samples, not groups, and
    the first node reading data after it gets a re-balance route from its own layout to
    itself when no route precedes it (and the layout has dp > 1).
    """
    # RunNode, or [src, dst, src_role, dst_role, edges, fields, at, keep_groups]
    steps: list[Any] = []
    location: ParallelLayout | None = None
    location_role = ""
    last_route: list[Any] | None = None
    fields: list[str] = list(graph.sources)
    written_on: dict[str, ParallelLayout] = {}
    grouped = True  # prompt groups must stay whole (no advantage node has run yet)
    rebalance = False  # the next data node needs a re-balance route if none precedes it
    for name in graph.order():
        node = graph.node(name)
        layout = roles[node.role]
        if node.inputs:
            in_place = rebalance and location == layout and layout.dp > 1
            if location is None:
                location, location_role = layout, node.role
            elif location != layout or in_place:
                last_route = [location, layout, node.role if in_place else location_role,
                              node.role, [], tuple(fields), name, grouped]
                steps.append(last_route)
                location, location_role = layout, node.role
            rebalance = False
            for edge in graph.producers(name):
                moved = written_on.get(edge.producer) != layout or in_place
                if edge.fields and moved and last_route:
                    last_route[4].append(edge.name)
        steps.append(RunNode(node=name, kind=node.kind, role=node.role,
                             ranks=_ranks(node, roles)))
        written_on[name] = location if location is not None else layout
        fields += [f for f in node.outputs if f not in fields]
        if balance and grouped and node.kind == "advantage":
            grouped, rebalance = False, True
    ops: list[Op] = []
    for step in steps:
        if isinstance(step, RunNode):
            ops.append(step)
            continue
        src, dst, src_role, dst_role, edges, carried, at, keep_groups = step
        ops.append(RouteOp(route=Route(name=f"{src_role}->{dst_role}@{at}", src=src, dst=dst,
                                       src_role=src_role, dst_role=dst_role,
                                       edges=tuple(edges), fields=carried,
                                       keep_groups=keep_groups)))
    return tuple(ops)
