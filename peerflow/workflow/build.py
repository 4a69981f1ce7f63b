"""Building the run's `WorkflowGraph` from the `workflow` config section."""

from __future__ import annotations

import difflib
from typing import Any

from peerflow.errors import ConfigError
from peerflow.workflow.builtin import BUILTIN_GRAPHS, BUILTIN_KINDS, KindSpec
from peerflow.workflow.graph import Node, WorkflowGraph
from peerflow.workflow.on_policy import FAST_PATH_GRAPHS, recompute_reasons
from peerflow.workflow.roles import ROLES


def node_kinds(pm: Any = None) -> dict[str, KindSpec]:
    """Built-in kinds plus the node types plugins registered (`peerflow_register_nodes`)."""
    kinds = dict(BUILTIN_KINDS)
    if pm is not None:
        registry = pm.registry("node")
        for name in registry.names():
            cls = registry.get(name)
            spec = getattr(cls, "spec", None)
            kinds.setdefault(name, spec() if callable(spec) else KindSpec(role="actor"))
    return kinds


def _builtin(name: str, config: Any) -> WorkflowGraph:
    try:
        factory = BUILTIN_GRAPHS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(BUILTIN_GRAPHS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"workflow.graph={name!r} is not a built-in graph.{hint} Choose one of "
            f"{', '.join(BUILTIN_GRAPHS)}, or describe the graph with workflow.nodes."
        ) from None
    options: dict[str, Any] = {"kl": None}
    if config is not None and config.algorithm.kl.coef > 0:
        options["kl"] = config.algorithm.kl.mode
    if config is not None and name in FAST_PATH_GRAPHS:
        options["old_logprobs"] = bool(recompute_reasons(config))
    return factory(**options)


def build_graph(config: Any, pm: Any = None) -> WorkflowGraph:
    """Returns the checked workflow graph of a `RunConfig`.

    Args:
        config: The run config (`config.workflow` selects the graph; the KL settings
            decide whether a built-in graph has a `ref_logprob` node, and an update
            of one optimiser step drops GRPO's `old_logprob` node, see
            `peerflow.workflow.on_policy`).
        pm: The plugin manager, to resolve plugin node types; `None` allows built-in
            kinds only.

    Raises:
        ConfigError: an unknown graph, kind or role, or a structural problem (cycle,
            missing input, duplicate output), each naming the node and the fix.
    """
    workflow = config.workflow
    if workflow.graph_name is not None:
        return _builtin(workflow.graph_name, config)
    kinds = node_kinds(pm)
    problems: list[str] = []
    nodes: list[Node] = []
    for i, spec in enumerate(workflow.nodes):
        kind = spec.kind or spec.name
        if kind not in kinds:
            close = difflib.get_close_matches(kind, list(kinds), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"workflow.nodes[{i}] ({spec.name!r}): unknown kind {kind!r}.{hint} Built-in "
                f"kinds: {', '.join(BUILTIN_KINDS)}; plugin node types: "
                f"{', '.join(k for k in kinds if k not in BUILTIN_KINDS) or 'none installed'} "
                "(a plugin registers more with peerflow_register_nodes)."
            )
            continue
        default = kinds[kind]
        role = spec.role or default.role
        if role not in ROLES:
            close = difflib.get_close_matches(role, ROLES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"workflow.nodes[{i}] ({spec.name!r}): unknown role {role!r}.{hint} Roles are "
                f"{', '.join(ROLES)}."
            )
            continue
        after = spec.after
        if after is None:
            after = [n.name for n in nodes if n.kind in default.after]
        nodes.append(Node(
            name=spec.name, kind=kind, role=role,
            inputs=default.inputs if spec.inputs is None else spec.inputs,
            outputs=default.outputs if spec.outputs is None else spec.outputs,
            after=after, options=dict(spec.options),
        ))
    if not workflow.nodes:
        problems.append("workflow.nodes is empty; list nodes or set workflow.graph: grpo.")
    if problems:
        raise ConfigError("\n".join(problems))
    return WorkflowGraph(nodes, workflow.sources)
