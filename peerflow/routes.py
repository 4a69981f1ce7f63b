"""Routes are data: the experts a mixture-of-experts model chose, as one batch field.

`ROUTES` (`routed_experts`) is a ragged field over each sample's prompt + response
tokens, int16 `[tokens, layers, top_k]` (logical expert ids; -1 = no route: layers
without a router, padding, the last sampled token, tool or environment tokens, rows an
engine did not return). It is an ordinary ragged field, so the coordinator moves, packs
and reshards it exactly like the token ids — in sync and async mode — with no code of its
own (a trailing shape travels in the wire header). The trainer replays it
(`peerflow.training.routing_replay`, `trainer.routing_replay: r3`).

int16 covers 32,767 experts; `[tokens, layers, k]` costs `2 * layers * k` bytes a token
(48 layers x top-8: 768 bytes, about 100x the token id), reported as `moe/route_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from peerflow.batch import Batch, RaggedField

#: The batch field of routes: int16 `[tokens, layers, top_k]`, ragged per sample.
ROUTES = "routed_experts"
#: The trainer's own routes from its old-log-prob pass (`trainer.routing_replay: r2`), the
#: same layout; set by `forward_logprobs`, so they travel with their samples to the update.
OLD_ROUTES = "old_routed_experts"


def routes_column(results: Sequence[Any], prompt_lengths: Sequence[int]) -> RaggedField | None:
    """Packs the rollout results' `routed_experts` into the `ROUTES` field.

    Args:
        results: `GenerationResult`s, one per sample.
        prompt_lengths: Each sample's prompt tokens.

    Returns:
        The field, or `None` when no result carries routes (a dense model, or an engine
        without `Capabilities.routed_experts`). A result without routes among others that
        have them gets -1 rows (it routes natively in replay).

    Raises:
        ValueError: a result's route count is not its prompt + answer token count, or
            results disagree on `[layers, top_k]` (never silently truncated).
    """
    routes = [getattr(r, "routed_experts", None) for r in results]
    shapes = {tuple(r.shape[1:]) for r in routes if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"rollout results carry routes of different [layers, top_k]: "
                         f"{sorted(shapes)}; one model must produce every result.")
    (trailing,) = shapes
    rows = []
    for result, row, prompt in zip(results, routes, prompt_lengths, strict=True):
        tokens = prompt + len(result.token_ids)
        if row is None:
            row = torch.full((tokens, *trailing), -1, dtype=torch.int16)
        elif len(row) != tokens:
            raise ValueError(
                f"rollout result (request {result.request_id}, sample {result.index}) has "
                f"{len(row)} routes for {prompt} prompt + {len(result.token_ids)} answer "
                "tokens; an engine must return one route per token (-1 where it has none).")
        rows.append(row.to(torch.int16))
    return RaggedField.from_tensors(rows, dtype=torch.int16)


def route_bytes(batch: Batch) -> int:
    """Bytes of the batch's `ROUTES` and `OLD_ROUTES` fields (values and offsets)."""
    total = 0
    for name in (ROUTES, OLD_ROUTES):
        if name in batch:
            field = batch.ragged(name)
            total += field.values.numel() * field.values.element_size() + \
                field.offsets.numel() * 8
    return total
