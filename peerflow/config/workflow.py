"""The `workflow` section: a built-in graph by name, or the nodes of a custom graph.

```yaml
workflow: {graph: grpo}          # or ppo; the default is grpo
workflow:
  nodes:
    - {name: generate, kind: generate}
    - {name: format, kind: reward, outputs: [format_reward], options: {reward: format}}
    - {name: correct, kind: reward, outputs: [correct_reward]}
    - {name: advantage, kind: advantage, inputs: [response_ids, format_reward, correct_reward]}
    - ...
```

A node's `kind` defaults to its `name`; `role`, `inputs`, `outputs` and `after` default to
the kind's (`peerflow.workflow.BUILTIN_KINDS` or the plugin node type's). The graph is
built and checked by `peerflow.workflow.build_graph` and `peerflow config validate`.
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.errors import ConfigError


@attrs.frozen(kw_only=True)
class NodeConfig:
    """One node of a custom workflow graph."""

    name: str
    """Unique node name."""
    kind: str | None = None
    """Built-in kind or registered node type; defaults to `name`."""
    role: str | None = None
    """Role that runs it (rollout, reward, actor, ref, critic); defaults to the kind's."""
    inputs: list[str] | None = None
    """Fields it reads; defaults to the kind's."""
    outputs: list[str] | None = None
    """Fields it writes; defaults to the kind's."""
    after: list[str] | None = None
    """Nodes it runs after although no field links them; defaults to the kind's."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """Kind-specific options."""


@attrs.frozen(kw_only=True)
class WorkflowConfig:
    """The workflow graph of a run."""

    graph: str | None = None
    """Built-in graph (`grpo`, `ppo`); the default when `nodes` is empty is `grpo`."""
    nodes: list[NodeConfig] = attrs.field(factory=list)
    """Nodes of a custom graph (instead of `graph`)."""
    sources: list[str] = attrs.field(factory=lambda: ["prompt_ids", "example"])
    """Fields the dataset provides before any node runs."""

    def __attrs_post_init__(self) -> None:
        if self.graph is not None and self.nodes:
            raise ConfigError(
                f"workflow: both graph={self.graph!r} and {len(self.nodes)} nodes are given; "
                "keep `graph` for a built-in graph or `nodes` for a custom one."
            )

    @property
    def graph_name(self) -> str | None:
        """The built-in graph selected (`grpo` by default), or `None` for custom nodes."""
        return None if self.nodes else (self.graph or "grpo")
