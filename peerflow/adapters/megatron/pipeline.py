"""Megatron's pipeline schedules for `MegatronTrainEngine` (a mixin), and its grad finalizer.

Forward and backward always go through `get_forward_backward_func`: no pipelining with
pp=1, 1F1B with pp>1. Micro-batches share one shape per mini-batch (`micro_batch_size ×
seq_length`, from the token budget), as the schedules' p2p buffers need; the objective
runs on the last stage, inside the schedule's loss function.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from peerflow.batch import Batch
from peerflow.training import (
    MicroBatch,
    Objective,
    PaddedInputs,
    fixed_shape_micro_batches,
    pad_inputs,
    pad_to_shape,
)
from peerflow.training.replay_scope import micro_batch_scope

if TYPE_CHECKING:
    from peerflow.adapters.megatron.engine import MegatronTrainEngine


class MegatronPipeline:
    """Micro-batch planning, forward and the schedule of `MegatronTrainEngine` (a mixin)."""

    def plan_micro_batches(self: MegatronTrainEngine, batch: Batch) -> list[MicroBatch]:
        """Micro-batches of one shape `[rows, width]`, as the schedules' p2p buffers need."""
        lengths = batch.token_count().tolist() if len(batch) else []
        plan, (rows, width) = fixed_shape_micro_batches(lengths, self.optim.micro_batch_tokens)

        def layout(part: Batch) -> PaddedInputs:
            return pad_to_shape(pad_inputs(part), rows, width)

        return [self.build_micro_batch(batch, indices, k == len(plan) - 1, layout)
                for k, indices in enumerate(plan)]

    def forward_micro(self: MegatronTrainEngine, micro: MicroBatch) -> torch.Tensor:
        """This stage's output: vocab-parallel logits `[B, L, V / tp]` on the last stage."""
        ids = micro.inputs.input_ids
        self._order.rows, self._order.width = ids.shape
        width = ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).triu(1)
        return self.model(ids, micro.inputs.position_ids, causal[None, None])

    def run_micro_batches(self: MegatronTrainEngine, micros: Sequence[MicroBatch],
                          objective: Objective) -> None:
        """Megatron's schedule (1F1B with pp > 1) over `micros`; backward unless no-grad.

        The objective runs on the last stage, inside the schedule's loss function. An MoE
        micro-batch's routing-replay scope (`micro_batch_scope`) opens before its forward
        and closes after its objective (Megatron recomputes nothing in backward, so the
        backward needs no routes). With `ep > 1` the loss is scaled by `1 / ep`: the ep
        peers forward the same samples, and Megatron sums their gradients.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        scale = 1.0 / self.context.layout.ep

        def forward_step(data_iterator: Iterator, model: Any) -> tuple[torch.Tensor, Any]:
            micro = next(data_iterator)
            scope = micro_batch_scope(self.routing, micro)
            scope.__enter__()
            try:
                output = self.forward_micro(micro)
            except BaseException:
                scope.__exit__(None, None, None)
                raise
            return output, partial(loss_step, micro, scope)

        def loss_step(micro: MicroBatch, scope: Any, output: torch.Tensor
                      ) -> tuple[Any, Any, dict]:
            tokens = micro.inputs.response_lengths.sum().to(torch.int)  # on the device
            try:
                value = objective(micro, output)
            finally:
                scope.__exit__(None, None, None)
            return (value * scale if scale != 1.0 else value), tokens, {}

        rows, width = micros[0].inputs.input_ids.shape
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micros), model=[self.model],
            num_microbatches=len(micros), seq_length=width, micro_batch_size=rows,
            forward_only=not torch.is_grad_enabled())

    def share_from_last_stage(self: MegatronTrainEngine, value: object) -> object:
        """Broadcasts a Python object from the last pipeline stage to the other stages."""
        import torch.distributed as dist

        if self.context.layout.pp == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.ps.get_pipeline_model_parallel_last_rank(),
                                   group=self.ps.get_pipeline_model_parallel_group())
        return box[0]


def finalize_without_token_scaling(model: list[Any], num_tokens: Any = None,
                                   **kwargs: Any) -> None:
    """Megatron's `finalize_model_grads` without dividing by the token count.

    PeerFlow losses are already normalised by the global token count, so the gradients
    are summed over dp ranks and micro-batches as they are.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)
