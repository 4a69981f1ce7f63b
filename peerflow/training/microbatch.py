"""Mini-batch splits and token-balanced micro-batches every dp-rank agrees on.

A micro-batch is right-padded, so it costs `num_samples * longest_sample` tokens.
`plan_micro_batches` sorts samples by length and cuts them into micro-batches within the
token budget where that saves more padding than another pass costs, so a long-tailed
batch (a few long answers among many short ones) is not padded to its longest answer. Engines
that run collectives inside every forward and backward (FSDP, ZeRO) need every dp-rank to
run the same number of micro-batches: the ranks agree on the largest count, and a rank
that needs fewer splits its costliest micro-batches (or runs empty filler passes).

A padding-free micro-batch (`peerflow.training.packing`) costs its real tokens only:
`pack_real_tokens` fills micro-batches up to the budget, largest samples first.

Pipeline schedules exchange activations of one shape per call instead;
`fixed_shape_micro_batches` plans those.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import torch

from peerflow.training.collectives import all_reduce_max

#: A micro-batch's fixed cost, in padded tokens, is `budget // OVERHEAD_DIVISOR`: a split
#: must save more padding than that to be worth another forward and backward.
OVERHEAD_DIVISOR = 64


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Packs sample indices into micro-batches of at most `budget` padded tokens.

    A micro-batch costs its padded tokens (`count * longest`) plus a fixed overhead
    (`budget // OVERHEAD_DIVISOR` tokens: parameter gathers, kernel launches, Python). The
    samples are sorted by length, longest first, and cut into consecutive runs that
    minimise the total cost (dynamic programming over the cut points), so similar
    lengths share a micro-batch and a long-tailed batch pays little padding, while a
    batch of near-equal lengths stays in as few micro-batches as the budget allows.

    Args:
        lengths: Tokens of each sample (prompt + response).
        budget: Most padded tokens (`count * longest`) per micro-batch; a sample longer
            than the budget gets a micro-batch of its own.

    Returns:
        Lists of sample indices, longest samples first; empty for no samples.

    Raises:
        ValueError: `budget` is below 1.
    """
    if budget < 1:
        raise ValueError(
            f"micro_batch_tokens={budget}: must be at least 1; set trainer.micro_batch_tokens."
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cuts = _cheapest_cuts([lengths[i] for i in order], budget, budget // OVERHEAD_DIVISOR)
    return [order[start:end] for start, end in itertools.pairwise(cuts)]


def _cheapest_cuts(longest_first: list[int], budget: int, overhead: int) -> list[int]:
    """Cut points `0 = c0 < c1 < … = n` of the cheapest split of a descending length list.

    The run `[i, j)` costs `(j - i) * lengths[i] + overhead` and holds at most
    `max(1, budget // lengths[i])` samples. Cuts are tried only at the ends of runs of
    equal lengths and at the budget's limit — a few dozen candidates even for hundreds
    of samples; a cut inside a run pays only in corner cases the budget shapes, and the
    result stays within 2 % of the exact optimum (tests/unit/test_training_toolkit.py).
    """
    n = len(longest_first)
    if n == 0:
        return []
    run_ends = [j for j in range(1, n + 1) if j == n or longest_first[j] != longest_first[j - 1]]

    def ends(start: int) -> list[int]:
        limit = min(n, start + max(1, budget // max(longest_first[start], 1)))
        found = run_ends[bisect.bisect_right(run_ends, start):bisect.bisect_right(run_ends, limit)]
        return found if found and found[-1] == limit else [*found, limit]

    starts, frontier = {0}, [0]
    while frontier:
        for end in ends(frontier.pop()):
            if end < n and end not in starts:
                starts.add(end)
                frontier.append(end)
    cost, best_end = {n: 0}, {}
    for start in sorted(starts, reverse=True):
        cost[start], best_end[start] = min(
            ((end - start) * longest_first[start] + overhead + cost[end], end)
            for end in ends(start))
    cuts = [0]
    while cuts[-1] < n:
        cuts.append(best_end[cuts[-1]])
    return cuts


def pack_real_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Packs sample indices into micro-batches of at most `budget` real tokens.

    For padding-free micro-batches, which cost the sum of their samples' tokens: first
    fit, longest samples first (few micro-batches, each nearly full); a sample longer
    than the budget gets a micro-batch of its own.

    Raises:
        ValueError: `budget` is below 1.
    """
    if budget < 1:
        raise ValueError(
            f"micro_batch_tokens={budget}: must be at least 1; set trainer.micro_batch_tokens."
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k, free in enumerate(room) if free >= lengths[i]), None)
        if k is None:
            bins.append([i])
            room.append(budget - lengths[i])
        else:
            bins[k].append(i)
            room[k] -= lengths[i]
    return bins


def split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int, *,
                   packed: bool = False) -> list[list[int]]:
    """Splits the costliest micro-batches in half until there are `count` of them.

    A micro-batch costs `count * longest` tokens, or the sum of its tokens when
    `packed` (padding-free). Micro-batches of one sample cannot split; empty ones pad
    the list up to `count`.
    """
    bins = [list(b) for b in bins]

    def cost(b: list[int]) -> int:
        sizes = [lengths[i] for i in b]
        return sum(sizes) if packed else len(b) * max(sizes, default=0)

    while len(bins) < count:
        costs = [cost(b) if len(b) > 1 else -1 for b in bins]
        if not bins or max(costs) < 0:
            bins.append([])
            continue
        k = costs.index(max(costs))
        half = len(bins[k]) // 2
        bins[k : k + 1] = [bins[k][:half], bins[k][half:]]
    return bins


def plan_micro_batches(
    lengths: Sequence[int],
    budget: int,
    group: object | None = None,
    *,
    packed: bool = False,
) -> list[list[int]]:
    """Token-balanced micro-batches, as many on this rank as on every rank of `group`.

    Args:
        lengths: Tokens (prompt + response) of each local sample.
        budget: Token budget of one micro-batch: padded tokens, or real ones when
            `packed` (padding-free micro-batches).
        group: The data-parallel group (collective on all its ranks), or `None`.
        packed: Plan padding-free micro-batches (`pack_real_tokens`).

    Returns:
        The same number (at least one) of index lists on every rank; some may be empty.
    """
    bins = pack_real_tokens(lengths, budget) if packed else pack_by_tokens(lengths, budget)
    count = all_reduce_max(max(len(bins), 1), group)
    return split_to_count(bins, lengths, count, packed=packed)


def fixed_shape_micro_batches(lengths: Sequence[int],
                              budget: int) -> tuple[list[list[int]], tuple[int, int]]:
    """Micro-batches of one shape `[rows, width]` for pipeline schedules.

    Every micro-batch is padded to the longest sample (`width`) and holds `rows =
    budget // width` samples (at least one), in the batch's order.

    Returns:
        `(index lists, (rows, width))`; one empty list for no samples.
    """
    if budget < 1:
        raise ValueError(
            f"micro_batch_tokens={budget}: must be at least 1; set trainer.micro_batch_tokens."
        )
    width = max(lengths, default=1)
    rows = max(1, budget // width)
    order = list(range(len(lengths)))
    return [order[i : i + rows] for i in range(0, len(order), rows)] or [[]], (rows, width)


def split_mini_batches(count: int, parts: int) -> list[list[int]]:
    """Splits `count` samples into `parts` contiguous runs of near-equal size.

    These are PPO mini-batches; a run is empty when there are fewer samples than parts.

    Raises:
        ValueError: `parts` is below 1.
    """
    if parts < 1:
        raise ValueError(f"mini_batches={parts}: must be at least 1; set trainer.mini_batches.")
    return [chunk.tolist() for chunk in torch.arange(count).tensor_split(parts)]
