"""Checks of the workflow and the layouts that `peerflow config validate` runs.

A core plugin (`peerflow_validate_config`, run by `peerflow.config.validate_config`), so
every problem —
unknown kinds or roles, cycles, missing inputs, an estimator that needs a critic the
graph lacks, layouts that do not fill the ranks, tp that does not divide the model's
attention heads — is reported before any process starts, naming the node or key and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peerflow.config.refusals import critic_problems
from peerflow.errors import ConfigError
from peerflow.plugins.hookspecs import hookimpl
from peerflow.workflow.roles import ROLES

#: Keys of a Hugging Face model config (or of `model.builder_options`) the checks read.
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "n_head_kv", "num_kv_heads")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")


def _first(mapping: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if isinstance(mapping.get(key), int):
            return mapping[key]
    return None


def model_shape(config: Any) -> tuple[dict[str, Any], str] | None:
    """Returns the model's config dict and where it came from, if it can be read cheaply."""
    if config.model.path:
        path = Path(config.model.path) / "config.json"
        if path.is_file():
            data = json.loads(path.read_text())
            return data.get("text_config", data), str(path)
        return None
    if config.model.builder_options:
        return dict(config.model.builder_options), "model.builder_options"
    return None


def check_model_layouts(config: Any, graph: Any, roles: dict[str, Any]) -> list[str]:
    """Checks that each role's tp divides the heads and pp fits the layers."""
    found = model_shape(config)
    if found is None:
        return []
    shape, source = found
    heads, kv, layers = _first(shape, _HEADS), _first(shape, _KV_HEADS), _first(shape, _LAYERS)
    problems = []
    checked: set[tuple[str, int, int]] = set()
    for name in graph.order():
        node = graph.node(name)
        layout = roles[node.role]
        section = ROLES[node.role].side
        key = (section, layout.tp, layout.pp)
        if key in checked:
            continue
        checked.add(key)
        where = f"node {name!r} (role {node.role}, {section}.layout {layout.describe()})"
        if heads and heads % layout.tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            problems.append(f"{where}: tp={layout.tp} does not divide the model's {heads} "
                            f"attention heads ({source}); set {section}.layout.tp to one of "
                            f"{divisors}.")
        if kv and layout.tp > 1 and kv % layout.tp and layout.tp % kv:
            problems.append(f"{where}: tp={layout.tp} and the model's {kv} key/value heads "
                            f"({source}) neither divide the other; choose tp dividing {kv} "
                            f"or a multiple of it.")
        if layers and layout.pp > layers:
            problems.append(f"{where}: pp={layout.pp} exceeds the model's {layers} layers "
                            f"({source}); set {section}.layout.pp to at most {layers}.")
    return problems


def validate_workflow(config: Any, pm: Any) -> list[str]:
    """Returns every workflow and layout problem of a config (empty when it can run)."""
    from peerflow.planner.placement import place_roles
    from peerflow.workflow.build import build_graph

    problems: list[str] = []
    try:
        graph = build_graph(config, pm)
    except ConfigError as exc:
        return str(exc).splitlines()
    fields = {f for n in graph.nodes for f in n.outputs}
    if pm is not None:
        problems += critic_problems(config, pm, {n.role for n in graph.nodes})
    registry = pm.registry("advantage_estimator") if pm is not None else None
    if registry is not None and config.algorithm.advantage in registry:
        estimator = registry.get(config.algorithm.advantage)
        if getattr(estimator, "needs_values", False) and "values" not in fields:
            users = [n.name for n in graph.nodes if n.kind == "advantage"] or ["advantage"]
            problems.append(
                f"node {users[0]!r}: algorithm.advantage={config.algorithm.advantage!r} reads "
                "`values` from a critic, but no node writes them; set workflow.graph: ppo or "
                "add a `values` node (role critic)."
            )
    try:
        roles = place_roles(config, config.runtime.nprocs)
    except ConfigError as exc:
        return problems + [f"{exc} (checked for runtime.nprocs={config.runtime.nprocs})"]
    return problems + check_model_layouts(config, graph, roles) + check_prompts_per_step(
        config, graph, roles)


def check_prompts_per_step(config: Any, graph: Any, roles: dict[str, Any]) -> list[str]:
    """Checks that every dp-rank of every role gets at least one prompt group a step."""
    widest = max(((roles[n.role].dp, n.role) for n in graph.nodes if n.role in roles),
                 default=(1, ""))
    dp, role = widest
    prompts = config.run.prompts_per_step
    if prompts >= dp:
        return []
    return [f"run.prompts_per_step={prompts} is smaller than the data-parallel size {dp} of "
            f"role {role!r} (runtime.nprocs={config.runtime.nprocs}, "
            f"{roles[role].describe()}): every dp-rank needs at least one prompt a step; set "
            f"run.prompts_per_step to at least {dp} (a multiple of {dp} balances the ranks), "
            "or use fewer processes."]


def check_async_program(config: Any, pm: Any) -> list[str]:
    """Settings `runtime.mode: async` cannot run (the planner's async program refuses them)."""
    if config.runtime.mode != "async":
        return []
    from peerflow.planner.plan import plan_run

    try:
        plan_run(config, config.runtime.nprocs, pm)
    except ConfigError as exc:
        return [str(exc)]
    return []


@hookimpl
def peerflow_validate_config(config: Any, pm: Any) -> list[str]:
    """The workflow graph, the layouts and, in async mode, the streaming program."""
    return validate_workflow(config, pm) + check_async_program(config, pm)
