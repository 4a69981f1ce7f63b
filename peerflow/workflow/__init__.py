"""The workflow graph: what runs, on which role, reading and writing which fields.

Interface for the worker (`peerflow.worker`) and plugin authors:

* `Node(name, kind, role, inputs, outputs, after, options)` and `WorkflowGraph(nodes)`
  (checked on construction: cycles, missing inputs, duplicate outputs);
* `grpo_graph(kl=…)`, `ppo_graph(kl=…)` — the built-in graphs; `BUILTIN_KINDS` — the
  built-in node kinds with their default role and fields;
* `build_graph(config, pm)` — the run's graph from `config.workflow` (YAML `{graph: grpo}`
  or `{nodes: [...]}`), resolving plugin node types (`NodeType` subclasses registered
  with `peerflow_register_nodes`).

Fan-out is one field read by several nodes; fan-in is a node reading fields of several
producers (e.g. two `reward` nodes writing `format_reward` and `correct_reward`).
"""

from peerflow.workflow.build import build_graph, node_kinds
from peerflow.workflow.builtin import (
    BUILTIN_GRAPHS,
    BUILTIN_KINDS,
    KindSpec,
    NodeType,
    grpo_graph,
    ppo_graph,
)
from peerflow.workflow.graph import SOURCE_FIELDS, Edge, Node, WorkflowGraph
from peerflow.workflow.roles import ROLES, Role

__all__ = [
    "BUILTIN_GRAPHS",
    "BUILTIN_KINDS",
    "ROLES",
    "SOURCE_FIELDS",
    "Role",
    "Edge",
    "KindSpec",
    "Node",
    "NodeType",
    "WorkflowGraph",
    "build_graph",
    "grpo_graph",
    "node_kinds",
    "ppo_graph",
]
