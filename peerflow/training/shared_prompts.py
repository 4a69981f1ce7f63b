"""Shared-prompt layout: the samples of one prompt run it once, in one row.

A GRPO group's answers share their prompt; laid out one sample per row
(`peerflow.training.inputs.pad_inputs`) the forward and backward run over the prompt once
per answer. Here the samples of a micro-batch that have the same prompt go into one row,
`[prompt, answer_1, answer_2, …]`, with an attention mask that lets each answer see the
prompt and its own earlier tokens only, and position ids that restart after the prompt for
every answer. A causal model's prompt positions do not depend on what follows them, so
each answer's log-probs are those of `prompt + answer` alone (the same numbers up to
floating-point summation order), and the prompt's activations receive the gradient of
every answer in the row — the gradient of running the prompt once per answer, summed.
Fewer positions go through every linear layer: on 4 answers averaging 128 tokens after a
128-token prompt, 640 instead of 1024.

Response token `j` of a sample is predicted at the prompt's last position (`j = 0`) or at
its own token `j - 1`; several samples share the first of those positions, so targets are
kept per response token (`response_targets`) rather than per position.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import torch

from peerflow.batch import Batch, RaggedField, offsets_from_lengths
from peerflow.training.inputs import check_kept, inputs_to

log = logging.getLogger("peerflow.training")


@attrs.frozen(kw_only=True)
class SharedPromptInputs:
    """One micro-batch laid out in rows of segments (a prompt, then its answers).

    One row per distinct prompt (see the module docstring), or every segment in one row
    (padding-free, `peerflow.training.packing`). Offers what the training toolkit reads
    from `PaddedInputs`: `input_ids`, `position_ids`, `attention_mask`, `logits_to_keep`,
    `samples`, `gather` and `response_targets`.
    """

    input_ids: torch.Tensor  # [R, L] int64, right-padded with 0
    position_ids: torch.Tensor  # [R, L] int64
    allowed: torch.Tensor | None  # [R, L, L] bool: query position may attend to key position
    """`None`: no mask; the attention keeps to each sample from `position_ids` alone."""
    positions: torch.Tensor  # [T] flat index (row * L + position) predicting each response token
    targets: torch.Tensor  # [T] the response tokens, sample after sample
    offsets: torch.Tensor  # [samples + 1] into `positions` / `targets`
    first_scored: int
    """Leftmost position (over rows) that predicts a response token."""
    samples: int

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """`[R, 1, L, L]` additive float32 mask (0 where allowed), transformers' custom 4D mask.

        Use `attention_mask_as(dtype)` for a model computing in another dtype.
        """
        return self.attention_mask_as(torch.float32)

    def attention_mask_as(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive 4D mask in `dtype` (the dtype the model's attention computes in).

        `None` without `allowed` (padding-free samples: the position ids delimit them).
        """
        if self.allowed is None:
            return None
        mask = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
        return mask.masked_fill_(~self.allowed, torch.finfo(dtype).min)[:, None]

    def to(self, device: torch.device) -> SharedPromptInputs:
        """These inputs with every tensor on `device` (the toolkit's crossing)."""
        return inputs_to(self, device)

    @property
    def logits_to_keep(self) -> int:
        """How many trailing positions hold every position that predicts a response token."""
        return max(self.input_ids.shape[1] - self.first_scored, 1)

    def gather(self, per_position: torch.Tensor) -> RaggedField:
        """Packs `[R, K, ...]` values of the last `K` positions at response tokens, ragged.

        Raises:
            ValueError: `per_position` lacks positions that predict response tokens.
        """
        rows, kept = per_position.shape[:2]
        width = self.input_ids.shape[1]
        check_kept(kept, self.logits_to_keep)
        row, pos = self.positions // width, self.positions % width - (width - kept)
        flat = per_position.reshape(rows * kept, *per_position.shape[2:])
        return RaggedField(values=flat[row * kept + pos], offsets=self.offsets)

    def response_targets(self) -> torch.Tensor:
        """The token each gathered position predicts, aligned with `gather`'s values."""
        return self.targets


#: transformers attention backends that apply an arbitrary 4D additive mask.
MASKABLE_ATTENTION = frozenset({"sdpa", "eager"})


def takes_custom_masks(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention backend applies the layout's 4D mask (logs if not)."""
    backend = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if backend in MASKABLE_ATTENTION:
        return True
    log.info("share_prompts is off: attention backend %r takes no custom 4D mask (%s do); "
             "each sample keeps a row of its own.", backend, sorted(MASKABLE_ATTENTION))
    return False


def shared_prompt_groups(prompts: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """Indices of the samples with the same prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    return list(groups.values())


def shared_prompt_units(batch: Batch, budget: int) -> tuple[list[list[int]], list[int]]:
    """The rows of `batch` in the shared-prompt layout, and the tokens of each.

    The samples with the same prompt share a row while the row (prompt once, then the
    answers) stays within `budget` tokens; a larger group is cut into several rows (first
    fit, in sample order), each with its own copy of the prompt, so a row never outgrows
    the micro-batch budget and its `[L, L]` attention mask stays within `budget ** 2`
    entries. A sample longer than
    the budget gets a row of its own. Two rows of one prompt together exceed the budget,
    so the micro-batch planner never puts them in one micro-batch (where
    `shared_prompt_inputs` would join them again).

    Returns:
        The sample indices of each row, and each row's tokens.
    """
    prompts = prompt_tuples(batch)
    prompt = batch.ragged("prompt_ids").lengths.tolist()
    answer = batch.ragged("response_ids").lengths.tolist()
    rows: list[list[int]] = []
    tokens: list[int] = []
    for group in shared_prompt_groups(prompts):
        head, first = prompt[group[0]], len(rows)
        for i in group:
            fits = (r for r in range(first, len(rows)) if tokens[r] + answer[i] <= budget)
            row = next(fits, None)
            if row is None:
                rows.append([i])
                tokens.append(head + answer[i])
            else:
                rows[row].append(i)
                tokens[row] += answer[i]
    return rows, tokens


def prompt_tuples(batch: Batch) -> list[tuple[int, ...]]:
    """Each sample's prompt ids as a tuple (hashable, for grouping)."""
    prompt = batch.ragged("prompt_ids")
    return [tuple(row.tolist()) for row in prompt.rows()]


def shared_prompt_inputs(batch: Batch) -> SharedPromptInputs:
    """Lays out `batch` one row per distinct prompt (see the module docstring).

    An empty batch becomes one filler row of a single token with no scored position.

    Raises:
        ValueError: A sample has no prompt token (nothing predicts its first token).
    """
    groups = shared_prompt_groups(prompt_tuples(batch)) if len(batch) else []
    return segment_inputs(batch, [[group] for group in groups], masked=True)


def segment_inputs(batch: Batch, rows: Sequence[Sequence[Sequence[int]]], *,
                   masked: bool) -> SharedPromptInputs:
    """Lays out `batch` as `rows` of segments, each a prompt then its samples' answers.

    A segment (a list of sample indices with one prompt) is `[prompt, answer_1, …]`;
    position ids count the prompt from 0 and restart after it for every answer, so a
    segment of one sample is numbered like its own sequence. Segments follow each other
    in a row, rows are right-padded.

    Args:
        batch: The micro-batch's samples.
        rows: Each row's segments; every sample in exactly one segment.
        masked: Build the `[R, L, L]` mask keeping answers and segments apart. Without
            it (`allowed=None`) no mask is passed: each segment must be one sample, and
            the model's attention confines itself to each from the position ids
            (padding-free, `peerflow.training.packing`).

    Raises:
        ValueError: A sample has no prompt token (nothing predicts its first token).
    """
    if len(batch) == 0:
        one = torch.zeros(1, 1, dtype=torch.int64)
        empty = torch.zeros(0, dtype=torch.int64)
        return SharedPromptInputs(
            input_ids=one, position_ids=one,
            allowed=torch.ones(1, 1, 1, dtype=torch.bool) if masked else None,
            positions=empty, targets=empty, offsets=torch.zeros(1, dtype=torch.int64),
            first_scored=0, samples=0)
    prompts = batch.ragged("prompt_ids").rows()
    responses = [row.to(torch.int64) for row in batch.ragged("response_ids").rows()]
    sizes = batch.ragged("response_ids").lengths.tolist()
    for i, prompt in enumerate(prompts):
        if not len(prompt):
            raise ValueError(
                f"sample {int(batch.sample_id[i])} has an empty prompt_ids; a causal LM "
                "needs at least one prompt token to predict the first response token.")
    width = max(sum(len(prompts[g[0]]) + sum(sizes[i] for i in g) for g in row)
                for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.int64)
    position_ids = torch.zeros(len(rows), width, dtype=torch.int64)
    segment = torch.full((len(rows), width), -1, dtype=torch.int64)  # segment index, -1 pad
    part = torch.full((len(rows), width), -1, dtype=torch.int64)  # -1 prompt, k answer k
    where: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * len(batch)
    steps = torch.arange(width)
    first_scored, count = width, 0
    for r, row in enumerate(rows):
        start = 0
        for group in row:
            prompt = prompts[group[0]]
            head = len(prompt)
            input_ids[r, start:start + head] = prompt
            position_ids[r, start:start + head] = steps[:head]
            segment[r, start:start + head + sum(sizes[i] for i in group)] = count
            prompt_end = start + head
            first_scored = min(first_scored, prompt_end - 1)
            start = prompt_end
            for k, i in enumerate(group):
                n = sizes[i]
                input_ids[r, start:start + n] = responses[i]
                position_ids[r, start:start + n] = steps[head:head + n]
                part[r, start:start + n] = k
                # Token j is predicted at the prompt's last position (j = 0), else at j - 1.
                own = steps[start - 1:start + n - 1] + r * width
                own[:1] = r * width + prompt_end - 1
                where[i] = own
                start += n
            count += 1
    return SharedPromptInputs(
        input_ids=input_ids, position_ids=position_ids,
        allowed=_segment_mask(segment, part) if masked else None,
        positions=torch.cat(where), targets=torch.cat(responses),
        offsets=offsets_from_lengths(sizes), first_scored=first_scored,
        samples=len(batch))


def _segment_mask(segment: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """`[R, L, L]`: causal, within a segment, an answer sees the prompt (-1) and itself.

    Padding (segment -1) attends to itself only, so no row of the mask is empty.
    """
    width = segment.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_segment = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    query, key = part[:, :, None], part[:, None, :]
    sees = same_segment & ((query == key) | (key == -1))
    pad_self = (segment[:, :, None] < 0) & torch.eye(width, dtype=torch.bool)
    return (causal & sees) | pad_self
