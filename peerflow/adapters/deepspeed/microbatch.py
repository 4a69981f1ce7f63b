"""Token-budget micro-batches and response log-probs for causal-LM train adapters.

Shared by the DeepSpeed and Megatron adapters (both train decoder-only causal LMs on
batches with ragged `prompt_ids` and `response_ids`). Sequences are concatenated prompt +
response and right-padded; the log-prob of response token `j` of a sample is read from the
logits at position `len(prompt) + j - 1`.

Every rank of a data-parallel group must run the same number of forward/backward passes
(ZeRO-3 gathers parameters per module, ZeRO-1/2 and Megatron reduce gradients per
micro-batch), so `plan_micro_batches` agrees on the count across the group and ranks with
fewer samples run empty "filler" micro-batches whose loss is zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from peerflow.batch import Batch, RaggedField


@attrs.frozen(kw_only=True)
class PaddedInputs:
    """One micro-batch laid out for a causal-LM forward."""

    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64, 1 on real tokens
    position_ids: torch.Tensor  # [B, L] int64
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]

    @property
    def target_ids(self) -> torch.Tensor:  # [B, L]
        """Token that each position predicts (the next input id; 0 past the end)."""
        return torch.nn.functional.pad(self.input_ids[:, 1:], (0, 1))

    def response_mask(self) -> torch.Tensor:  # [B, L] bool
        """True at positions whose *prediction* is a response token."""
        pos = torch.arange(self.input_ids.shape[1])[None, :]
        start = (self.prompt_lengths - 1)[:, None]
        return (pos >= start) & (pos < start + self.response_lengths[:, None])

    def gather(self, per_position: torch.Tensor) -> RaggedField:
        """Packs `[B, L]` per-position values at response positions into a ragged field."""
        device = per_position.device
        return RaggedField(
            values=per_position[self.response_mask().to(device)],
            offsets=torch.nn.functional.pad(torch.cumsum(self.response_lengths, 0),
                                            (1, 0)).to(device),
        )


def sequence_tokens(batch: Batch) -> list[int]:
    """Returns prompt + response length of every sample."""
    return (batch.lengths("prompt_ids") + batch.lengths("response_ids")).tolist()


def pack_indices(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Splits sample indices, in order, into runs whose padded size fits `budget` tokens.

    A micro-batch costs `count × longest` tokens once padded; a sample longer than the
    budget gets a micro-batch of its own.

    Args:
        lengths: Sequence length of every sample.
        budget: Most padded tokens in one micro-batch.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        widest = max(longest, int(length))
        if current and widest * (len(current) + 1) > budget:
            groups.append(current)
            current, widest = [], int(length)
        current.append(index)
        longest = widest
    if current:
        groups.append(current)
    return groups


def agree_count(count: int, group: object | None) -> int:
    """Returns the largest `count` over the ranks of `group` (itself without a group)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return count
    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


def plan_micro_batches(batch: Batch, budget: int, group: object | None) -> list[list[int]]:
    """Packs `batch` into micro-batches; pads with empty lists to the group's largest count."""
    groups = pack_indices(sequence_tokens(batch), budget) if len(batch) else []
    total = agree_count(len(groups), group)
    return groups + [[] for _ in range(total - len(groups))]


def split_even(indices: Sequence[int], parts: int) -> list[list[int]]:
    """Splits indices into `parts` contiguous runs of near-equal size (PPO mini-batches)."""
    size, extra = divmod(len(indices), parts)
    out, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        out.append(list(indices[start:end]))
        start = end
    return out


def pad_inputs(batch: Batch, pad_to: int = 1) -> PaddedInputs:
    """Concatenates prompt and response ids and right-pads them.

    Args:
        batch: Samples with ragged `prompt_ids` and `response_ids`.
        pad_to: Round the padded length up to a multiple of this (Megatron's sequence
            parallelism and some kernels want multiples of tp).

    An empty batch becomes one filler row of a single token so a forward still runs.
    """
    if len(batch) == 0:
        one = torch.ones(1, max(1, pad_to), dtype=torch.int64)
        return PaddedInputs(
            input_ids=one * 0, attention_mask=one, position_ids=torch.zeros_like(one),
            prompt_lengths=torch.ones(1, dtype=torch.int64),
            response_lengths=torch.zeros(1, dtype=torch.int64),
        )
    prompts = batch.ragged("prompt_ids").rows()
    responses = batch.ragged("response_ids").rows()
    seqs = [torch.cat([p, r]).to(torch.int64) for p, r in zip(prompts, responses)]
    longest = max(len(s) for s in seqs)
    longest = -(-longest // pad_to) * pad_to
    input_ids = torch.zeros(len(seqs), longest, dtype=torch.int64)
    mask = torch.zeros(len(seqs), longest, dtype=torch.int64)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(
                f"sample {int(batch.sample_id[row])} has an empty prompt; a causal LM needs at "
                "least one prompt token to predict the first response token."
            )
    position_ids = torch.arange(longest)[None, :].expand(len(seqs), -1).contiguous()
    return PaddedInputs(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
        prompt_lengths=batch.lengths("prompt_ids"),
        response_lengths=batch.lengths("response_ids"),
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Returns `log_softmax(logits)[target]` in float32 for full-vocabulary logits."""
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def global_counts(batch: Batch, group: object | None) -> tuple[int, int]:
    """Returns `(response tokens, samples)` of `batch` summed over the ranks of `group`."""
    import torch.distributed as dist

    value = torch.tensor([int(batch.lengths("response_ids").sum()) if len(batch) else 0,
                          len(batch)], dtype=torch.int64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return int(value[0]), int(value[1])


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """Returns `batch` with its tensor fields on `device` (itself when already there)."""
    if device.type == "cpu":
        return batch
    fields = {}
    for name, column in batch.fields.items():
        if isinstance(column, RaggedField):
            fields[name] = RaggedField(values=column.values.to(device),
                                       offsets=column.offsets.to(device))
        elif isinstance(column, torch.Tensor):
            fields[name] = column.to(device)
        else:
            fields[name] = column
    return Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                 weight_version=batch.weight_version, fields=fields)


def empty_like_logprobs(batch: Batch) -> RaggedField:
    """Returns zero log-probs aligned with `response_ids`.

    For a rank with no samples (or only empty responses), which still ran filler passes.
    """
    if "response_ids" not in batch:
        return RaggedField(values=torch.zeros(0), offsets=torch.zeros(len(batch) + 1,
                                                                      dtype=torch.int64))
    lengths = batch.lengths("response_ids")
    return RaggedField(values=torch.zeros(int(lengths.sum())),
                       offsets=torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)))


def pad_to_shape(inputs: PaddedInputs, rows: int, length: int) -> PaddedInputs:
    """Pads a micro-batch to exactly `[rows, length]` with empty filler rows.

    Pipeline schedules exchange activations of one fixed shape per call.
    """
    count, width = inputs.input_ids.shape
    pad = (0, length - width, 0, rows - count)
    lengths_pad = (0, rows - count)
    return PaddedInputs(
        input_ids=torch.nn.functional.pad(inputs.input_ids, pad),
        attention_mask=torch.nn.functional.pad(inputs.attention_mask, pad),
        position_ids=torch.arange(length)[None, :].expand(rows, -1).contiguous(),
        prompt_lengths=torch.nn.functional.pad(inputs.prompt_lengths, lengths_pad, value=1),
        response_lengths=torch.nn.functional.pad(inputs.response_lengths, lengths_pad),
    )
