"""Causal-LM inputs of a micro-batch: prompt + response, right-padded.

The log-prob (or value) of response token `j` of a sample is read at position
`len(prompt) + j - 1`, the position that predicts it; `PaddedInputs.response_mask` marks
those positions and `PaddedInputs.gather` packs per-position values there into a ragged
field aligned with `response_ids`.

Inputs are laid out on the host from a host micro-batch, then cross to the engine's
device whole (`PaddedInputs.to`, called by the toolkit); `gather` runs where the model's
output is, with the inputs already there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import attrs
import torch

from peerflow.batch import Batch, RaggedField, offsets_from_lengths

_Inputs = TypeVar("_Inputs")


def inputs_to(inputs: _Inputs, device: torch.device) -> _Inputs:
    """`inputs` (an attrs class of a micro-batch's tensors) with every tensor on `device`."""
    moved = {field.name: value.to(device) for field in attrs.fields(type(inputs))
             if isinstance(value := getattr(inputs, field.name), torch.Tensor)}
    return attrs.evolve(inputs, **moved)


@attrs.frozen(kw_only=True)
class PaddedInputs:
    """One micro-batch laid out for a causal-LM forward."""

    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64, 1 on real tokens
    position_ids: torch.Tensor  # [B, L] int64
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B], 0 on filler rows
    samples: int
    """Real samples: the first rows; the rest are filler rows without response tokens."""

    @property
    def target_ids(self) -> torch.Tensor:  # [B, L]
        """Token that each position predicts (the next input id; 0 past the end)."""
        return torch.nn.functional.pad(self.input_ids[:, 1:], (0, 1))

    def response_mask(self) -> torch.Tensor:  # [B, L] bool
        """True at positions whose *prediction* is a response token."""
        pos = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)[None, :]
        start = (self.prompt_lengths - 1)[:, None]
        return (pos >= start) & (pos < start + self.response_lengths[:, None])

    @property
    def logits_to_keep(self) -> int:
        """How many trailing positions hold every position that predicts a response token.

        A causal LM may compute its output (the vocabulary projection) for these last
        positions only — transformers' `logits_to_keep` — since prompt positions'
        predictions are never scored; at least 1 (a filler pass).
        """
        scored = self.response_lengths > 0
        if not bool(scored.any()):
            return 1
        return self.input_ids.shape[1] - int(self.prompt_lengths[scored].min()) + 1

    def attention_mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The `[B, L]` padding mask (the model builds its causal mask from it; any dtype)."""
        return self.attention_mask

    def to(self, device: torch.device) -> PaddedInputs:
        """These inputs with every tensor on `device` (the toolkit's crossing)."""
        return inputs_to(self, device)

    def response_targets(self) -> torch.Tensor:
        """The response tokens, sample after sample, aligned with `gather`'s values."""
        return self.gather(self.target_ids).values

    def gather(self, per_position: torch.Tensor) -> RaggedField:
        """Packs `[B, K, ...]` per-position values at response positions, ragged.

        `K` is the sequence width `L`, or fewer when the model computed only the last
        `K >= logits_to_keep` positions (those are aligned to the right). One row per
        real sample, aligned with its `response_ids` (filler rows dropped).

        Raises:
            ValueError: `per_position` lacks positions that predict response tokens.
        """
        kept = per_position.shape[1]
        check_kept(kept, self.logits_to_keep)
        offsets = offsets_from_lengths(self.response_lengths[: self.samples])
        mask = self.response_mask()[:, self.input_ids.shape[1] - kept:]
        return RaggedField(values=per_position[mask], offsets=offsets)


def check_kept(kept: int, needed: int) -> None:
    """Raises unless a model output of `kept` trailing positions holds the `needed` ones.

    Raises:
        ValueError: `kept < needed` (the model skipped positions that predict responses).
    """
    if kept < needed:
        raise ValueError(
            f"the model returned {kept} positions but response tokens are predicted "
            f"from the last {needed}; pass logits_to_keep="
            "inputs.logits_to_keep (or 0 for every position)."
        )


def pad_inputs(batch: Batch) -> PaddedInputs:
    """Concatenates prompt and response ids and right-pads them.

    An empty batch becomes one filler row of a single token, so a forward still runs
    (ranks with fewer samples keep collectives in step that way).

    Raises:
        ValueError: A sample has no prompt token (nothing predicts its first token).
    """
    if len(batch) == 0:
        one = torch.ones(1, 1, dtype=torch.int64)
        return PaddedInputs(input_ids=one * 0, attention_mask=one,
                            position_ids=torch.zeros_like(one),
                            prompt_lengths=torch.ones(1, dtype=torch.int64),
                            response_lengths=torch.zeros(1, dtype=torch.int64), samples=0)
    prompt, response = batch.ragged("prompt_ids"), batch.ragged("response_ids")
    prompt_lengths, response_lengths = prompt.lengths, response.lengths
    if bool((prompt_lengths == 0).any()):
        row = int(torch.nonzero(prompt_lengths == 0)[0])
        raise ValueError(
            f"sample {int(batch.sample_id[row])} has an empty prompt_ids; a causal LM "
            "needs at least one prompt token to predict the first response token."
        )
    lengths = prompt_lengths + response_lengths
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    input_ids = torch.zeros(len(batch), width, dtype=torch.int64)
    input_ids[mask] = _concat_rows(prompt, response)
    return PaddedInputs(
        input_ids=input_ids, attention_mask=mask.to(torch.int64),
        position_ids=torch.arange(width)[None, :].expand(len(batch), -1).contiguous(),
        prompt_lengths=prompt_lengths, response_lengths=response_lengths,
        samples=len(batch),
    )


def _concat_rows(first: RaggedField, second: RaggedField) -> torch.Tensor:
    """Row `i` of `first` then row `i` of `second`, for every row, packed (one gather)."""
    lengths = first.lengths + second.lengths
    row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    local = torch.arange(int(lengths.sum())) - offsets_from_lengths(lengths)[:-1][row]
    head = first.lengths[row]
    source = torch.where(local < head, first.offsets[:-1][row] + local,
                         len(first.values) + second.offsets[:-1][row] + local - head)
    return torch.cat([first.values, second.values.to(first.values.dtype)])[source]


def pad_to_shape(inputs: PaddedInputs, rows: int, width: int) -> PaddedInputs:
    """Pads a micro-batch to exactly `[rows, width]` with filler rows.

    Pipeline schedules exchange activations of one fixed shape per call.
    """
    count, current = inputs.input_ids.shape
    pad = (0, width - current, 0, rows - count)
    return PaddedInputs(
        input_ids=torch.nn.functional.pad(inputs.input_ids, pad),
        attention_mask=torch.nn.functional.pad(inputs.attention_mask, pad),
        position_ids=torch.arange(width)[None, :].expand(rows, -1).contiguous(),
        prompt_lengths=torch.nn.functional.pad(inputs.prompt_lengths, (0, rows - count),
                                               value=1),
        response_lengths=torch.nn.functional.pad(inputs.response_lengths, (0, rows - count)),
        samples=inputs.samples,
    )


def gather_results(count: int, parts: Sequence[tuple[Sequence[int], RaggedField]]
                   ) -> RaggedField:
    """Brings per-micro-batch results back to the host, in batch order (one copy).

    Args:
        count: Samples in the batch (`0..count-1`).
        parts: Each micro-batch's batch indices and its results, one row per index, on
            the engine's device.

    Returns:
        A float32 host field with row `i` for sample `i`.

    Raises:
        KeyError: A sample's row is missing (a micro-batch plan that dropped it).
    """
    produced = [i for indices, _ in parts for i in indices]
    missing = sorted(set(range(count)) - set(produced))
    if missing:
        raise KeyError(f"no micro-batch produced samples {missing[:5]}; the plan lost them.")
    if not parts:
        return RaggedField.from_tensors([], dtype=torch.float32)
    values = torch.cat([field.values.detach().float() for _, field in parts]).cpu()
    lengths = torch.cat([field.lengths for _, field in parts]).cpu()
    joined = RaggedField(values=values, offsets=offsets_from_lengths(lengths))
    order = torch.empty(count, dtype=torch.int64)
    order[torch.tensor(produced, dtype=torch.int64)] = torch.arange(len(produced))
    return joined.select(order)
