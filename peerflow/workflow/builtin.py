"""Built-in node kinds, user node types, and the GRPO and PPO graphs.

A kind's `KindSpec` gives the default role and fields of a node of that kind, so a YAML
node may write just `{name: reward, kind: reward}`. What a kind *does* on a rank is the
worker's business (`peerflow.worker`); a plugin node type subclasses `NodeType` and
implements `run`.

Fields (see `peerflow.algorithms.base` for their shapes): `prompt_ids`, `example` (from
the dataset), `response_ids`, `rollout_logprobs`, `reward`, `old_logprobs`,
`ref_logprobs`, `values`, `advantages`, `returns`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from peerflow.workflow.graph import SOURCE_FIELDS, Node, WorkflowGraph


@attrs.frozen(kw_only=True)
class KindSpec:
    """Defaults of one node kind."""

    role: str
    """Role a node of this kind runs on unless it names another."""
    inputs: tuple[str, ...] = ()
    """Fields it reads by default."""
    outputs: tuple[str, ...] = ()
    """Fields it writes by default."""
    after: tuple[str, ...] = ()
    """Kinds it runs after by default (resolved to nodes of those kinds)."""
    phase: str = "per_step"
    """Where async mode runs it (`peerflow.planner.streaming`)."""


#: The built-in node kinds.
BUILTIN_KINDS: dict[str, KindSpec] = {
    "generate": KindSpec(role="rollout", inputs=("prompt_ids",),
                         outputs=("response_ids", "rollout_logprobs"), phase="generate"),
    "reward": KindSpec(role="reward", inputs=("response_ids", "example"), outputs=("reward",),
                       phase="per_group"),
    "ref_logprob": KindSpec(role="ref", inputs=("prompt_ids", "response_ids"),
                            outputs=("ref_logprobs",), phase="per_micro_batch"),
    "old_logprob": KindSpec(role="actor", inputs=("prompt_ids", "response_ids"),
                            outputs=("old_logprobs",), phase="per_micro_batch"),
    "values": KindSpec(role="critic", inputs=("prompt_ids", "response_ids"), outputs=("values",),
                       phase="per_micro_batch"),
    "advantage": KindSpec(role="actor", inputs=("response_ids", "reward"),
                          outputs=("advantages", "returns")),
    "train_actor": KindSpec(role="actor",
                            inputs=("prompt_ids", "response_ids", "advantages", "old_logprobs")),
    "train_critic": KindSpec(role="critic",
                             inputs=("prompt_ids", "response_ids", "returns", "values")),
    "sync_weights": KindSpec(role="actor", after=("train_actor",), phase="weight_sync"),
}


class NodeType:
    """Base class of every node kind, registered through `peerflow_register_nodes`.

    The built-in kinds are subclasses too (`peerflow.worker.nodes`). Subclasses set `name`
    (what `workflow.nodes[].kind` selects), `role`, `inputs`, `outputs` and `phase`
    defaults, and implement `run`, which every rank of the node's role calls with its
    dp-shard of the step's batch (async mode: see `peerflow.planner.streaming`).
    """

    name: ClassVar[str]
    role: ClassVar[str] = "actor"
    inputs: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ()
    phase: ClassVar[str] = "per_step"

    def __init__(self, node: Node, config: Any) -> None:
        self.node = node
        self.config = config

    def run(self, batch: Any, context: Any) -> Mapping[str, Any]:
        """Returns the new fields (`node.outputs`) for `batch`.

        Args:
            batch: This dp-rank's `peerflow.Batch`, holding at least `node.inputs`.
            context: A `peerflow.worker.node_context.NodeContext` (the built-in kinds
                get the same): `engine(role)`, `rewards(name)`, `process_group(role)`,
                `algorithm`, `step`, `options`, `metrics`, `config`, `prompts`,
                `generate(draws, sampling)`, `sync_weights()`.
        """
        raise NotImplementedError(f"node type {type(self).__name__} must implement run()")

    @classmethod
    def spec(cls) -> KindSpec:
        """The defaults a YAML node of this type inherits."""
        return KindSpec(role=cls.role, inputs=tuple(cls.inputs), outputs=tuple(cls.outputs),
                        phase=cls.phase)


def _node(kind: str, name: str | None = None, **changes: Any) -> Node:
    spec = BUILTIN_KINDS[kind]
    values: dict[str, Any] = {"role": spec.role, "inputs": spec.inputs,
                              "outputs": spec.outputs, "after": spec.after}
    values.update(changes)
    return Node(name=name or kind, kind=kind, **values)


def _kl_inputs(kl: str | None) -> tuple[list[Node], tuple[str, ...], list[str]]:
    """Returns the reference node (if any) and where `ref_logprobs` flows for `kl`."""
    if kl not in (None, "loss", "reward"):
        raise ValueError(f"kl={kl!r}: expected None, 'loss' or 'reward'")
    if kl is None:
        return [], (), []
    to_advantage = ("ref_logprobs",) if kl == "reward" else ()
    to_loss = ["ref_logprobs"] if kl == "loss" else []
    return [_node("ref_logprob")], to_advantage, to_loss


def grpo_graph(*, kl: str | None = None, old_logprobs: bool = True) -> WorkflowGraph:
    """GRPO: generate → reward → (ref_logprob) → old_logprob → advantage → train → sync.

    Args:
        kl: Include the frozen reference model (`ref_logprob`) and feed its log-probs to
            the loss (`"loss"`) or to the advantage node's reward penalty (`"reward"`).
        old_logprobs: Recompute the trainer's log-probs before the update; without it
            (one optimiser step per batch, see `peerflow.workflow.on_policy`) the loss
            takes the detached current log-probs as the proximal policy and still weighs
            them against `rollout_logprobs`.
    """
    ref_nodes, advantage_extra, loss_extra = _kl_inputs(kl)
    train_inputs = ["prompt_ids", "response_ids", "advantages", *loss_extra]
    nodes = [_node("generate"), _node("reward"), *ref_nodes]
    if old_logprobs:
        nodes.append(_node("old_logprob"))
        train_inputs.append("old_logprobs")
    else:
        train_inputs.append("rollout_logprobs")
    nodes += [
        _node("advantage", inputs=("response_ids", "reward", *advantage_extra),
              outputs=("advantages",)),
        _node("train_actor", inputs=tuple(train_inputs)),
        _node("sync_weights", after=("train_actor",), options={"target": "rollout"}),
    ]
    return WorkflowGraph(nodes, SOURCE_FIELDS)


def ppo_graph(*, kl: str | None = None) -> WorkflowGraph:
    """PPO with a critic: GRPO's nodes plus `values` and `train_critic`; GAE advantages.

    Args:
        kl: As for `grpo_graph`.
    """
    ref_nodes, advantage_extra, loss_extra = _kl_inputs(kl)
    train_inputs = ["prompt_ids", "response_ids", "advantages", "old_logprobs", *loss_extra]
    nodes = [_node("generate"), _node("reward"), *ref_nodes]
    nodes += [
        _node("old_logprob"),
        _node("values"),
        _node("advantage", inputs=("response_ids", "reward", "values", *advantage_extra)),
        _node("train_actor", inputs=tuple(train_inputs)),
        _node("train_critic"),
        _node("sync_weights", after=("train_actor",), options={"target": "rollout"}),
    ]
    return WorkflowGraph(nodes, SOURCE_FIELDS)


#: Built-in graphs selectable as `workflow.graph`.
BUILTIN_GRAPHS = {"grpo": grpo_graph, "ppo": ppo_graph}
