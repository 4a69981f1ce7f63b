"""Token-balanced micro-batches every dp-rank agrees on, and their padded model inputs.

Samples are right-padded inside a micro-batch, so its cost is
`num_samples * longest_sample`. Sorting by length and filling micro-batches up to the
token budget keeps similar lengths together (little padding) and balances tokens.
FSDP runs collectives in every forward and backward, so all dp-ranks must run the same
number of micro-batches: each rank computes the count it needs, the ranks agree on the
largest, and a rank that needs fewer splits its largest micro-batches (or runs empty
ones, which the engine turns into zero-loss passes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from peerflow.batch import Batch


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Packs sample indices into micro-batches of at most `budget` padded tokens.

    Args:
        lengths: Tokens of each sample (prompt + response).
        budget: Most padded tokens (`count * longest`) per micro-batch; a sample longer
            than the budget gets a micro-batch of its own.

    Returns:
        Lists of sample indices, longest samples first; empty for no samples.
    """
    if budget < 1:
        raise ValueError(f"micro_batch_tokens={budget}: must be at least 1.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for index in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
            bins[-1].append(index)
        else:
            bins.append([index])
    return bins


def split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Splits the costliest micro-batches in half until there are `count` of them.

    Micro-batches of one sample cannot split; empty ones pad the list up to `count`.
    """
    bins = [list(b) for b in bins]
    while len(bins) < count:
        costs = [len(b) * max((lengths[i] for i in b), default=0) if len(b) > 1 else -1
                 for b in bins]
        if not bins or max(costs) < 0:
            bins.append([])
            continue
        k = costs.index(max(costs))
        half = len(bins[k]) // 2
        bins[k : k + 1] = [bins[k][:half], bins[k][half:]]
    return bins


def agree_micro_batches(
    lengths: Sequence[int],
    budget: int,
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """Token-balanced micro-batches, as many on this rank as on every rank of `group`.

    Args:
        lengths: Tokens of each local sample.
        budget: Padded-token budget of one micro-batch.
        group: The data-parallel group (collective on all its ranks), or `None`.
        device: Where the count is reduced (the group's backend device).

    Returns:
        The same number of index lists on every rank; some may be empty.
    """
    bins = pack_by_tokens(lengths, budget)
    count = max(len(bins), 1)
    if group is not None and dist.get_world_size(group) > 1:
        agreed = torch.tensor([count], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        count = int(agreed.item())
    return split_to_count(bins, lengths, count)


def padded_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + response` token rows of a micro-batch.

    Returns:
        `(ids, mask, targets)`: ids and attention mask `[batch, width]`, and
        `targets` `[batch, width - 1]`, True at the positions whose next token is a
        response token (reading them in row-major order follows `response_ids`).

    Raises:
        ValueError: A sample has no prompt token (nothing predicts its first token).
    """
    prompts = batch.ragged("prompt_ids").rows()
    responses = batch.ragged("response_ids").rows()
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.zeros((len(batch), width - 1), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) == 0:
            raise ValueError(
                f"sample {int(batch.sample_id[b])} has an empty prompt_ids; every sample "
                "needs at least one prompt token."
            )
        ids[b, : len(p) + len(r)] = torch.cat([p, r])
        mask[b, : len(p) + len(r)] = 1
        targets[b, len(p) - 1 : len(p) + len(r) - 1] = True
    return ids, mask, targets
