"""Pluggable samplers: which buffered samples form a trainer's next micro-batch.

A sampler sees the samples a trainer dp-rank holds for the current step (in arrival
order, with their group ids and token counts) and picks the next micro-batch, or nothing
when no micro-batch is full yet. Built in (`runtime.sampler`):

* `sequential` — arrival order; a micro-batch closes when the next sample would not fit.
* `grouped` — like `sequential` but never splits the answers of one prompt (losses that
  normalise per group, such as GRPO's sequence-mean variants, need them together).
* `length_balanced` — first-fit-decreasing packing by tokens, so micro-batches are evenly
  filled; closes when the budget is at least `fill` full.

Registered like a plugin's (`peerflow_register_samplers`); a plugin adds one the same way,
on a `Sampler` subclass carrying `name`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from peerflow.plugins.hookspecs import hookimpl


@attrs.frozen(kw_only=True)
class PooledSample:
    """What a sampler knows about one buffered sample."""

    sample_id: int
    group_id: int
    tokens: int
    """Prompt plus response tokens."""


@attrs.frozen(kw_only=True)
class MicroBatchBudget:
    """Limits of one micro-batch."""

    max_tokens: int
    """Token budget (`trainer.micro_batch_tokens`); one larger sample goes alone."""
    max_samples: int = 0
    """Most samples (0: no limit)."""

    def fits(self, tokens: int, samples: int) -> bool:
        """Whether a micro-batch of that size is within the budget."""
        return tokens <= self.max_tokens and (not self.max_samples or samples <= self.max_samples)


class Sampler(abc.ABC):
    """Chooses the samples of the next micro-batch from a trainer's pool."""

    name: ClassVar[str]
    """The name `runtime.sampler` selects."""

    @abc.abstractmethod
    def select(
        self, pool: Sequence[PooledSample], budget: MicroBatchBudget, final: bool
    ) -> list[int]:
        """Returns pool positions of the next micro-batch, or `[]` to wait for more.

        Args:
            pool: Buffered samples in arrival order.
            budget: Micro-batch limits.
            final: The step has no more samples coming: return a micro-batch even when it
                is not full (`[]` only for an empty pool).
        """


def _prefix(
    units: list[list[int]], pool: Sequence[PooledSample], budget: MicroBatchBudget, final: bool
) -> list[int]:
    chosen: list[int] = []
    tokens = 0
    for unit in units:
        unit_tokens = sum(pool[i].tokens for i in unit)
        if chosen and not budget.fits(tokens + unit_tokens, len(chosen) + len(unit)):
            return chosen  # the next unit does not fit: the micro-batch is full
        chosen += unit
        tokens += unit_tokens
        if not budget.fits(tokens, len(chosen)) or (
            budget.max_samples and len(chosen) == budget.max_samples
        ):
            return chosen  # an oversize unit goes alone; a sample-count budget is met
    return chosen if final else []


class SequentialSampler(Sampler):
    """Arrival order, splitting groups freely."""

    name = "sequential"

    def select(
        self, pool: Sequence[PooledSample], budget: MicroBatchBudget, final: bool
    ) -> list[int]:
        """See `Sampler.select`."""
        return _prefix([[i] for i in range(len(pool))], pool, budget, final)


class GroupedSampler(Sampler):
    """Arrival order, whole prompt groups only."""

    name = "grouped"

    def select(
        self, pool: Sequence[PooledSample], budget: MicroBatchBudget, final: bool
    ) -> list[int]:
        """See `Sampler.select`."""
        units: dict[int, list[int]] = {}
        for i, sample in enumerate(pool):
            units.setdefault(sample.group_id, []).append(i)
        return _prefix(list(units.values()), pool, budget, final)


@attrs.define
class LengthBalancedSampler(Sampler):
    """First-fit-decreasing packing by tokens."""

    name: ClassVar[str] = "length_balanced"
    fill: float = 0.9
    """Close a micro-batch once this fraction of the token budget is packed."""

    def select(
        self, pool: Sequence[PooledSample], budget: MicroBatchBudget, final: bool
    ) -> list[int]:
        """See `Sampler.select`."""
        order = sorted(range(len(pool)), key=lambda i: (-pool[i].tokens, i))
        chosen: list[int] = []
        tokens = 0
        for i in order:
            if not chosen or budget.fits(tokens + pool[i].tokens, len(chosen) + 1):
                chosen.append(i)
                tokens += pool[i].tokens
        full = (
            tokens >= self.fill * budget.max_tokens
            or (budget.max_samples and len(chosen) >= budget.max_samples)
            or len(chosen) < len(pool)  # something was left out because it did not fit
        )
        return sorted(chosen) if (full or final) else []


@hookimpl
def peerflow_register_samplers(register: Any) -> None:
    """Registers the built-in samplers (this module is a core plugin)."""
    for cls in (SequentialSampler, GroupedSampler, LengthBalancedSampler):
        register(cls)
