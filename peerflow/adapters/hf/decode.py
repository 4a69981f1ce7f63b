"""The hf engine's batched prefill + decode loop over rows of one generate call.

Prompts are left-padded so every row's newest token sits in the last column, and each
prompt is prefilled once, its `DynamicCache` rows then repeated for its n samples (what
vLLM's prefix cache gives parallel sampling). Rows that finish are dropped from the batch
and the cache once a quarter of them are done, so the loop's cost follows the unfinished
rows, and it stops as soon as every row is done.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from peerflow.adapters.hf.routes import GenerationRoutes
from peerflow.adapters.hf.sampling import sample_next
from peerflow.adapters.hf.stops import StopStringMatcher
from peerflow.engines import SamplingParams


@attrs.define(eq=False)
class Row:
    """One sequence being sampled: which request, which sample, what it produced."""

    request_index: int
    sample_index: int
    prompt: tuple[int, ...]
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    finish_reason: str = "length"
    done: bool = False
    stopped_on_string: bool = False
    routes: list[torch.Tensor] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class Decoding:
    """What one call's decode loops share."""

    sampling: SamplingParams
    generator: torch.Generator
    stop_ids: set[int]
    """EOS ids and `sampling.stop_token_ids`."""
    matcher: StopStringMatcher | None
    pad_token_id: int
    device: torch.device
    routes: GenerationRoutes
    """Records every token's experts (MoE models)."""


def _left_padded(prompts: list[tuple[int, ...]], pad_token_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of `prompts`, left-padded to the longest."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return input_ids.to(device), mask.to(device)


def _append(rows: list[Row], active: list[int], tokens: torch.Tensor,
            logprobs: torch.Tensor, run: Decoding) -> list[int]:
    """Appends each active row's sampled token; returns the positions still going."""
    keep: list[int] = []
    sampled = zip(tokens.tolist(), logprobs.tolist(), strict=True)
    for i, (token, logprob) in enumerate(sampled):
        row = rows[active[i]]
        if row.done:
            continue
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if token in run.stop_ids:
            row.finish_reason, row.done = "stop", True
        elif run.matcher is not None and run.matcher.hit(row.tokens):
            row.finish_reason, row.done, row.stopped_on_string = "stop", True, True
        else:
            keep.append(i)
    return keep


def decode(model: Any, rows: list[Row], run: Decoding) -> None:
    """Runs one batched prefill + decode loop over `rows` (filled in place)."""
    from transformers import DynamicCache

    unique: dict[int, int] = {}
    prompts: list[tuple[int, ...]] = []
    expand: list[int] = []
    for row in rows:
        if row.request_index not in unique:
            unique[row.request_index] = len(prompts)
            prompts.append(row.prompt)
        expand.append(unique[row.request_index])
    input_ids, mask = _left_padded(prompts, run.pad_token_id, run.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    active = list(range(len(rows)))
    sampling = run.sampling
    for step in range(sampling.max_tokens):
        with run.routes.call() as routes:
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True, logits_to_keep=1,
                           ).logits[:, -1]
        if step == 0:
            run.routes.prefill(rows, routes, prompts, expand, input_ids.shape[1])
        else:
            run.routes.decode(rows, active, routes)
        if step == 0 and len(prompts) < len(rows):
            index = torch.tensor(expand, device=run.device)
            cache.batch_select_indices(index)
            logits, mask, positions = logits[index], mask[index], positions[index]
        tokens, logprobs = sample_next(logits, temperature=sampling.temperature,
                                       top_k=sampling.top_k, top_p=sampling.top_p,
                                       generator=run.generator)
        keep = _append(rows, active, tokens, logprobs, run)
        if not keep:
            break
        # Dropping finished rows copies the cache; worth it once a quarter are done.
        # Until then they ride along (their samples are ignored).
        if len(keep) <= 0.75 * len(active):
            index = torch.tensor(keep, device=run.device)
            cache.batch_select_indices(index)
            tokens, mask, positions = tokens[index], mask[index], positions[index]
            active = [active[i] for i in keep]
        input_ids = tokens[:, None]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
        positions = positions[:, -1:] + 1
