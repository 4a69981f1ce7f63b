"""Node kinds at run time: one registered class per kind, run against a narrow context.

Every kind — built-in or a plugin's — is a `peerflow.workflow.NodeType` subclass
registered with `peerflow_register_nodes`. This module is a core plugin: it registers
the built-in kinds, each made of its defaults (`peerflow.workflow.BUILTIN_KINDS`) and its
executor (`peerflow.worker.executors`). `run_node` looks a node's kind up in the registry
and runs it with a `NodeContext` (`peerflow.worker.node_context`), the same for built-in
and plugin kinds, in the lockstep and streaming schedules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from peerflow.batch import Batch
from peerflow.plugins.hookspecs import hookimpl
from peerflow.worker.executors import BUILTIN_EXECUTORS, Executor
from peerflow.worker.metrics import StepMetrics
from peerflow.worker.node_context import NodeContext
from peerflow.workflow.builtin import BUILTIN_KINDS, KindSpec, NodeType

if TYPE_CHECKING:
    from peerflow.worker.runtime import WorkerRuntime


class BuiltinNode(NodeType):
    """A built-in node kind: its `BUILTIN_KINDS` defaults and its executor."""

    executor: ClassVar[Executor]

    def run(self, batch: Batch, context: NodeContext) -> Batch:
        """Runs the executor on this rank's batch; returns the batch with its outputs."""
        return self.executor(context, batch)

    @classmethod
    def spec(cls) -> KindSpec:
        """The kind's defaults (`peerflow.workflow.BUILTIN_KINDS`)."""
        return BUILTIN_KINDS[cls.name]


def _builtin(kind: str, executor: Executor) -> type[BuiltinNode]:
    spec = BUILTIN_KINDS[kind]
    name = "".join(part.title() for part in kind.split("_")) + "Node"
    return type(name, (BuiltinNode,), {
        "name": kind, "role": spec.role, "inputs": spec.inputs, "outputs": spec.outputs,
        "phase": spec.phase, "executor": staticmethod(executor),
        "__doc__": executor.__doc__, "__module__": __name__,
    })


#: The built-in node kinds, as registered classes.
BUILTIN_NODE_TYPES = tuple(_builtin(kind, fn) for kind, fn in BUILTIN_EXECUTORS.items())


@hookimpl
def peerflow_register_nodes(register: Any) -> None:
    """Registers the built-in node kinds (this module is a core plugin)."""
    for cls in BUILTIN_NODE_TYPES:
        register(cls)


def run_node(rt: WorkerRuntime, node: Any, batch: Batch, metrics: StepMetrics) -> Batch:
    """Runs one workflow node on this rank; returns the batch with the node's outputs.

    A kind's `run(batch, context)` returns the batch, or a mapping of new fields (a
    plugin's usual answer), which are added to it.

    Raises:
        UnknownNameError: no registered kind has the node's `kind`.
        ValueError: the node's output does not fit the batch: a field of another length,
            or off the host (batches live there; docs/architecture.md), naming the node.
    """
    kind = rt.pm.get("node", node.kind)
    out = kind(node, rt.config).run(batch, rt.node_context(node, metrics))
    where = f"workflow node {node.name!r} (kind {node.kind!r})"
    if isinstance(out, Batch):
        if out.device.type != "cpu":
            raise ValueError(f"{where} returned a batch on {out.device}; nodes hand batches "
                             "on the host: bring engine results back where they leave the "
                             "engine (docs/architecture.md, 'Where tensors live').")
        return out
    for name, column in dict(out or {}).items():
        try:
            if isinstance(column, list) and column and not isinstance(column[0], torch.Tensor):
                batch.set_objects(name, column)
            else:
                batch.set(name, column)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return batch
