"""Deterministic, length-balanced, group-preserving sample assignment (pure functions).

Every rank of a route computes the same assignment from the same all-gathered metadata,
so no rank has to decide and broadcast it. Groups (the answers to one prompt) are kept
whole; group loads (tokens) are balanced over the consumer dp-ranks:

1. small instances (few groups) are solved exactly by branch and bound under a node
   budget, so the result is optimal where an imbalance would be most visible;
2. larger ones use longest-processing-time-first (a heap), then a local search that
   moves or swaps groups between the busiest and the least-loaded dp-rank while that
   lowers the busiest load.

Ties always break on the lower index, so the result depends only on the inputs.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

#: Groups up to this count are assigned exactly (branch and bound).
EXACT_GROUPS = 14
#: Search-node budget of the exact solver before it keeps the best assignment found.
EXACT_BUDGET = 200_000


def _lpt(loads: Sequence[int], bins: int, order: Sequence[int]) -> list[int]:
    heap = [(0, b) for b in range(bins)]
    out = [0] * len(loads)
    for g in order:
        load, b = heapq.heappop(heap)
        out[g] = b
        heapq.heappush(heap, (load + loads[g], b))
    return out


def _bin_loads(loads: Sequence[int], assign: Sequence[int], bins: int) -> list[int]:
    totals = [0] * bins
    for g, b in enumerate(assign):
        totals[b] += loads[g]
    return totals


def _first_by_load(members: Sequence[int], loads: Sequence[int]) -> dict[int, int]:
    """Lowest unit index of each distinct load among `members`."""
    first: dict[int, int] = {}
    for g in members:
        if loads[g] not in first or g < first[loads[g]]:
            first[loads[g]] = g
    return first


def _best_move(loads: Sequence[int], hi_members: Sequence[int], lo_members: Sequence[int],
               hi_total: int, lo_total: int) -> tuple[int, int, int] | None:
    """The move or swap from the busiest to the least-loaded bin that lowers the pair's peak.

    Returns `(new peak of the pair, g, h)` (`h = -1`: move `g` alone), the smallest such
    triple over all candidates, or `None`. Units of equal load are interchangeable, so
    only the lowest index of each distinct load is tried, and for each load in the busy
    bin only the two loads of the other bin nearest the ideal swap (`d = gap / 2`; the
    pair's peak grows with `|d - gap / 2|`): O(D log D) for D distinct loads, not
    O(n²) pairs.
    """
    gap = hi_total - lo_total
    hi_first = _first_by_load(hi_members, loads)
    lo_first = _first_by_load(lo_members, loads)
    lo_loads = sorted(lo_first)
    best: tuple[int, int, int] | None = None
    for load_g, g in hi_first.items():
        options = [(load_g, -1)] if 0 < load_g < gap else []
        at = bisect.bisect_left(lo_loads, load_g - gap / 2)
        options += [(load_g - lo_loads[k], lo_first[lo_loads[k]])
                    for k in (at - 1, at) if 0 <= k < len(lo_loads)]
        for d, h in options:
            if 0 < d < gap:
                cand = (max(hi_total - d, lo_total + d), g, h)
                best = cand if best is None or cand < best else best
    return best


def _refine(loads: Sequence[int], assign: list[int], bins: int, rounds: int) -> list[int]:
    totals = _bin_loads(loads, assign, bins)
    members: list[list[int]] = [[] for _ in range(bins)]
    for g, b in enumerate(assign):
        members[b].append(g)
    for _ in range(rounds):
        hi = max(range(bins), key=lambda b: (totals[b], -b))
        lo = min(range(bins), key=lambda b: (totals[b], b))
        if totals[hi] <= totals[lo]:
            break
        best = _best_move(loads, members[hi], members[lo], totals[hi], totals[lo])
        if best is None or best[0] >= totals[hi]:
            break
        _, g, h = best
        members[hi].remove(g)
        members[lo].append(g)
        totals[hi] -= loads[g]
        totals[lo] += loads[g]
        assign[g] = lo
        if h >= 0:
            members[lo].remove(h)
            members[hi].append(h)
            totals[lo] -= loads[h]
            totals[hi] += loads[h]
            assign[h] = hi
    return assign


def _exact(loads: Sequence[int], bins: int, order: list[int], start: list[int]) -> list[int]:
    best_assign = list(start)
    best = max(_bin_loads(loads, start, bins))
    lower = max(max(loads), -(-sum(loads) // bins))
    if best <= lower:
        return best_assign
    totals = [0] * bins
    current = [0] * len(loads)
    budget = [EXACT_BUDGET]

    def search(i: int, peak: int) -> bool:
        nonlocal best, best_assign
        budget[0] -= 1
        if budget[0] < 0:
            return True
        if i == len(order):
            if peak < best:
                best, best_assign = peak, list(current)
            return best <= lower
        g = order[i]
        seen: set[int] = set()
        for b in range(bins):
            if totals[b] in seen or totals[b] + loads[g] >= best:
                continue
            seen.add(totals[b])  # bins with equal load are interchangeable
            totals[b] += loads[g]
            current[g] = b
            done = search(i + 1, max(peak, totals[b]))
            totals[b] -= loads[g]
            if done:
                return True
        return False

    search(0, 0)
    return best_assign


def balance_groups(loads: Sequence[int], bins: int) -> list[int]:
    """Assigns each group to one of `bins` consumers, minimising the busiest consumer's load.

    Args:
        loads: Token load of each group (non-negative).
        bins: Number of consumers (dp-ranks).

    Returns:
        The consumer index of each group.
    """
    if bins < 1:
        raise ValueError(f"balance_groups: bins={bins}; need at least one consumer.")
    if not loads:
        return []
    loads = [int(x) for x in loads]
    order = sorted(range(len(loads)), key=lambda g: (-loads[g], g))
    assign = _lpt(loads, bins, order)
    if bins == 1:
        return assign
    if len(loads) <= EXACT_GROUPS:
        return _exact(loads, bins, order, assign)
    return _refine(loads, assign, bins, rounds=4 * bins + 16)


def balance_groups_local(
    loads: Sequence[int], bins: int, home: Sequence[int], slack: float = 0.05
) -> list[int]:
    """Like `balance_groups`, but keeps groups on their `home` consumer when that is cheap.

    A group whose producer is also a rank of consumer `home[g]` (colocated layouts) moves
    no bytes if it stays there. Groups are kept home, heaviest first, while the home's load
    stays within the balanced peak; the rest are placed longest-first and refined. The
    result is used only if its busiest load is within `1 + slack` of the balanced one;
    when every group has a home, and keeping them all there is no busier, nothing moves.

    Args:
        loads: Token load of each group.
        bins: Number of consumers.
        home: Preferred consumer of each group, or -1 for none.
        slack: Tolerated increase of the busiest load for locality.

    Returns:
        The consumer index of each group.
    """
    balanced = balance_groups(loads, bins)
    if not loads or bins == 1 or all(h < 0 for h in home):
        return balanced
    peak = max(_bin_loads(loads, balanced, bins))
    order = sorted(range(len(loads)), key=lambda g: (-loads[g], g))
    totals = [0] * bins
    assign = [-1] * len(loads)
    for g in order:
        h = home[g]
        if 0 <= h < bins and totals[h] + loads[g] <= peak:
            assign[g] = h
            totals[h] += loads[g]
    heap = [(totals[b], b) for b in range(bins)]
    heapq.heapify(heap)
    for g in order:
        if assign[g] < 0:
            load, b = heapq.heappop(heap)
            assign[g] = b
            heapq.heappush(heap, (load + loads[g], b))
    local_peak = max(_bin_loads(loads, assign, bins))
    chosen = assign if local_peak <= peak * (1 + slack) else balanced
    if all(0 <= h < bins for h in home):  # never busier than moving nothing
        stay = list(home)
        if max(_bin_loads(loads, stay, bins)) <= max(_bin_loads(loads, chosen, bins)):
            return stay
    return chosen
