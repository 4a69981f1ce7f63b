"""Laying routes out on a micro-batch and the routing-replay scope the toolkit opens.

`micro_batch_scope` is what `CausalLMTrainEngine.run_micro_batches` (and an adapter that
runs its own schedule, such as Megatron's) opens around one micro-batch: it picks the
routes to force from the batch (`r3`: `routed_experts`; `r2`: `old_routed_experts`, or
records them in the old-log-prob pass) and lays them out like the micro-batch's
`input_ids` (`routes_on_inputs`), failing closed on a token-count or layer mismatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from peerflow.batch import RaggedField
from peerflow.routes import OLD_ROUTES, ROUTES
from peerflow.training.routing_replay import RoutingReplay


def routes_on_inputs(routes: RaggedField, inputs: Any, *, num_layers: int,
                     top_k: int) -> torch.Tensor:
    """Lays a micro-batch's routes out like its `input_ids`, flattened: `[B * L, layers, k]`.

    Args:
        routes: Ragged routes, one row per real sample over its prompt + response tokens.
        inputs: The micro-batch's `PaddedInputs` (right-padded rows, one per sample).
        num_layers: Layers of the model.
        top_k: Experts per token.

    Raises:
        ValueError: a sample's route count differs from its token count, or the inputs are
            not one padded row per sample (padding-free or shared-prompt rows).
    """
    from peerflow.training.inputs import PaddedInputs

    if not isinstance(inputs, PaddedInputs):
        raise ValueError(
            f"routing replay lays routes out on padded micro-batches, not {type(inputs).__name__}; "
            "set trainer.padding_free: false and trainer.fsdp.share_prompts: false (or "
            "trainer.routing_replay: off).")
    rows, width = inputs.input_ids.shape
    out = torch.full((rows, width, num_layers, top_k), -1, dtype=torch.int16,
                     device=inputs.input_ids.device)
    if inputs.samples:
        tokens = (inputs.prompt_lengths + inputs.response_lengths)[: inputs.samples]
        lengths = routes.lengths.to(tokens.device)
        if not torch.equal(lengths, tokens):
            bad = int((lengths != tokens).nonzero()[0, 0])
            raise ValueError(
                f"routes of sample {bad} of the micro-batch cover {int(lengths[bad])} tokens but "
                f"it has {int(tokens[bad])} (prompt + response); the engine that recorded them "
                "must return one route per token (-1 where it has none).")
        if routes.values.shape[1:] != (num_layers, top_k):
            raise ValueError(
                f"routes have [layers, top_k] = {list(routes.values.shape[1:])} but the model has "
                f"[{num_layers}, {top_k}]; they were recorded for another model.")
        mask = inputs.attention_mask[: inputs.samples].bool()
        out[: inputs.samples][mask] = routes.values.to(out.device, torch.int16)
    return out.reshape(rows * width, num_layers, top_k)


def routes_from_inputs(recorded: torch.Tensor, inputs: Any) -> RaggedField:
    """The inverse of `routes_on_inputs`: one ragged row per real sample, on the host."""
    rows, width = inputs.input_ids.shape
    grid = recorded.reshape(rows, width, *recorded.shape[1:])[: inputs.samples]
    mask = inputs.attention_mask[: inputs.samples].bool()
    values = grid[mask].cpu()
    tokens = (inputs.prompt_lengths + inputs.response_lengths)[: inputs.samples].cpu()
    from peerflow.batch import offsets_from_lengths

    return RaggedField(values=values, offsets=offsets_from_lengths(tokens))


@contextlib.contextmanager
def micro_batch_scope(controller: RoutingReplay | None, micro: Any) -> Iterator[None]:
    """What the toolkit opens around one micro-batch's forward and backward.

    Under `r3` the batch's `ROUTES` are replayed; under `r2` a pass without gradient
    records the trainer's own routes (`RoutingReplay.take` hands them to the batch) and a
    pass with gradient replays the batch's `OLD_ROUTES` — a batch without them (no
    old-log-prob pass ran: the planner drops it with one optimiser step per batch, whose
    forward is then the first) routes natively;
    under `off` (and for a dense model, `controller is None`) routing is native.

    Raises:
        ValueError: `r3` and the micro-batch has no `ROUTES` field (the rollout engine did
            not return routes).
    """
    if controller is None:
        yield
        return
    inputs, batch = micro.inputs, micro.batch
    forced, record = None, False
    if controller.mode == "r3":
        if ROUTES not in batch:
            raise ValueError(
                f"trainer.routing_replay: r3 replays the rollout engine's routes, but the batch "
                f"has no {ROUTES!r} field; use a rollout backend that declares "
                "Capabilities.routed_experts (hf), or set trainer.routing_replay: r2.")
        forced = routes_on_inputs(batch.ragged(ROUTES), inputs, num_layers=controller.num_layers,
                                  top_k=controller.top_k)
    elif controller.mode == "r2" and torch.is_grad_enabled() and OLD_ROUTES in batch:
        forced = routes_on_inputs(batch.ragged(OLD_ROUTES), inputs,
                                  num_layers=controller.num_layers, top_k=controller.top_k)
    elif controller.mode == "r2":
        record = True
    mask = getattr(inputs, "attention_mask", None)
    real = mask if mask is not None and mask.shape == inputs.input_ids.shape else None
    with controller.forcing(forced, record=record, real=real):
        yield
        if record and inputs.samples:
            controller.store(batch.sample_id, routes_from_inputs(controller.recorded(), inputs))
