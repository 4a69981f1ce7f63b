"""The workflow graph: nodes that read and write batch fields, and the edges between them.

A `Node` names its `kind` (what it does: `generate`, `reward`, …, or a plugin's node
type), its `role` (which engine group runs it: `rollout`, `reward`, `actor`, `ref`,
`critic`), the batch fields it reads (`inputs`) and writes (`outputs`), and optional
control dependencies (`after`, e.g. `sync_weights` after `train_actor`). Data edges follow
from the fields: the node that writes a field feeds every node that reads it, so fan-out
(one producer, many readers) and fan-in (one reader of several producers' fields) need no
special syntax. Fields nobody writes must be *source* fields, provided by the dataset
(`prompt_ids`, `example`).

`WorkflowGraph(nodes)` checks the structure when built and raises one `ConfigError`
listing every problem (duplicate names or outputs, missing inputs, cycles), each naming
the node and the fix. Role and layout checks that need the run config live in
`peerflow.planner.validate`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from peerflow.errors import ConfigError

#: Fields the dataset provides before any node runs.
SOURCE_FIELDS: tuple[str, ...] = ("prompt_ids", "example")


def _names(value: Iterable[str] | None) -> tuple[str, ...]:
    return tuple(value or ())


@attrs.frozen(kw_only=True)
class Node:
    """One step of the workflow, run by every rank of its role's worker group."""

    name: str
    """Unique node name (what programs, routes and error messages show)."""
    kind: str
    """What the node does: a built-in kind (`peerflow.workflow.BUILTIN_KINDS`) or the name
    of a node type registered with `peerflow_register_nodes`."""
    role: str
    """The engine group that runs it (one of `ROLES`)."""
    inputs: tuple[str, ...] = attrs.field(default=(), converter=_names)
    """Batch fields it reads."""
    outputs: tuple[str, ...] = attrs.field(default=(), converter=_names)
    """Batch fields it writes."""
    after: tuple[str, ...] = attrs.field(default=(), converter=_names)
    """Names of nodes that must finish first although no field links them."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """Kind-specific options (e.g. `target: rollout` for `sync_weights`, `reward: name`)."""


@attrs.frozen(kw_only=True)
class Edge:
    """A dependency between two nodes: the fields `producer` writes that `consumer` reads."""

    producer: str
    """Name of the upstream node."""
    consumer: str
    """Name of the downstream node."""
    fields: tuple[str, ...] = ()
    """Fields that flow along the edge; empty for a pure control edge (`after`)."""

    @property
    def name(self) -> str:
        """`producer->consumer`, how plans and messages refer to the edge."""
        return f"{self.producer}->{self.consumer}"


@attrs.define(eq=False)
class WorkflowGraph:
    """A validated DAG of `Node`s.

    Args:
        nodes: The nodes, in declaration order (ties in the topological order keep it).
        sources: Fields available before any node runs (from the dataset).

    Raises:
        ConfigError: listing every structural problem found.
    """

    nodes: tuple[Node, ...] = attrs.field(converter=tuple)
    sources: tuple[str, ...] = attrs.field(default=SOURCE_FIELDS, converter=tuple)
    _by_name: dict[str, Node] = attrs.field(init=False, factory=dict)
    _edges: tuple[Edge, ...] = attrs.field(init=False, default=())
    _order: tuple[str, ...] = attrs.field(init=False, default=())

    def __attrs_post_init__(self) -> None:
        problems: list[str] = []
        for node in self.nodes:
            if node.name in self._by_name:
                problems.append(f"workflow node {node.name!r} is defined twice; rename one.")
            self._by_name[node.name] = node
        producer: dict[str, str] = {}
        for node in self.nodes:
            for field in node.outputs:
                if field in producer and producer[field] != node.name:
                    problems.append(
                        f"workflow nodes {producer[field]!r} and {node.name!r} both write field "
                        f"{field!r}; give one of them another output name (fan-in reads "
                        "differently named fields)."
                    )
                elif field in self.sources:
                    problems.append(
                        f"workflow node {node.name!r} writes {field!r}, which the dataset "
                        "already provides; rename the output."
                    )
                producer.setdefault(field, node.name)
        edges: dict[tuple[str, str], list[str]] = {}
        for node in self.nodes:
            for field in node.inputs:
                if field in self.sources:
                    continue
                if field not in producer:
                    writers = ", ".join(sorted(producer)) or "none"
                    problems.append(
                        f"workflow node {node.name!r} reads field {field!r}, which no node writes "
                        f"and the dataset does not provide (sources: {', '.join(self.sources)}; "
                        f"written fields: {writers}); add a node that outputs it or fix the name."
                    )
                    continue
                edges.setdefault((producer[field], node.name), []).append(field)
            for dep in node.after:
                if dep not in self._by_name:
                    problems.append(
                        f"workflow node {node.name!r} runs after {dep!r}, which is not a node; "
                        f"nodes are {', '.join(self._by_name)}."
                    )
                    continue
                edges.setdefault((dep, node.name), [])
        self._edges = tuple(
            Edge(producer=p, consumer=c, fields=tuple(f)) for (p, c), f in edges.items()
        )
        if not problems:
            problems += self._sort()
        if problems:
            raise ConfigError("\n".join(problems))

    def _sort(self) -> list[str]:
        indegree = {n.name: 0 for n in self.nodes}
        children: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for edge in self._edges:
            if edge.producer == edge.consumer:
                return [f"workflow node {edge.producer!r} reads its own output "
                        f"{edge.fields or 'via after'}; split it into two nodes."]
            indegree[edge.consumer] += 1
            children[edge.producer].append(edge.consumer)
        position = {n.name: i for i, n in enumerate(self.nodes)}
        ready = sorted((n for n, d in indegree.items() if d == 0), key=position.__getitem__)
        order: list[str] = []
        while ready:
            name = ready.pop(0)
            order.append(name)
            for child in children[name]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
                    ready.sort(key=position.__getitem__)
        if len(order) < len(self.nodes):
            stuck = [n for n in indegree if indegree[n] > 0]
            return [f"workflow graph has a cycle through nodes {', '.join(stuck)}; remove one "
                    "of their edges (a field read or an `after` entry)."]
        self._order = tuple(order)
        return []

    @property
    def edges(self) -> tuple[Edge, ...]:
        """Every data and control edge, in declaration order."""
        return self._edges

    def order(self) -> tuple[str, ...]:
        """Node names in a deterministic topological order (declaration order breaks ties)."""
        return self._order

    def node(self, name: str) -> Node:
        """Returns the node called `name`.

        Raises:
            KeyError: no such node (naming the nodes that exist).
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"workflow has no node {name!r}; it has {list(self._by_name)}") from None

    def producers(self, name: str) -> tuple[Edge, ...]:
        """Edges into node `name`."""
        return tuple(e for e in self._edges if e.consumer == name)

    def consumers(self, name: str) -> tuple[Edge, ...]:
        """Edges out of node `name`."""
        return tuple(e for e in self._edges if e.producer == name)

    def roles(self) -> tuple[str, ...]:
        """Roles the graph uses, in first-use order."""
        return tuple(dict.fromkeys(self.node(n).role for n in self._order))

    def kinds(self) -> tuple[str, ...]:
        """Node kinds the graph uses."""
        return tuple(dict.fromkeys(n.kind for n in self.nodes))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `peerflow plan --format json`."""
        return {
            "order": list(self._order),
            "sources": list(self.sources),
            "nodes": [
                {"name": n.name, "kind": n.kind, "role": n.role, "inputs": list(n.inputs),
                 "outputs": list(n.outputs), "after": list(n.after), "options": n.options}
                for n in (self.node(x) for x in self._order)
            ],
            "edges": [{"producer": e.producer, "consumer": e.consumer, "fields": list(e.fields)}
                      for e in self._edges],
        }

    @classmethod
    def from_nodes(cls, nodes: Sequence[Node], sources: Sequence[str] = SOURCE_FIELDS):
        """Builds and checks a graph (same as the constructor; reads well at call sites)."""
        return cls(nodes, sources)
