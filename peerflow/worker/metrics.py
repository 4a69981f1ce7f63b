"""Per-step metrics: collected on every rank, reduced across ranks, written once.

Each rank records scalars with a reduction (`mean` weighted by a count, `sum`, `max`,
`min`). At the end of a step the ranks exchange these few numbers (an all-gather of a
small dict — metadata, not data) and every rank computes the same reduced values; the
output writer on rank 0 then appends one line to `metrics.jsonl`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from peerflow.algorithms.overlong import TRUNCATED
from peerflow.batch import Batch

log = logging.getLogger("peerflow.worker")

Reduce = Literal["mean", "sum", "max", "min"]


@attrs.define(eq=False)
class StepMetrics:
    """The scalar metrics one rank records during one step."""

    _values: dict[str, tuple[str, float, float]] = attrs.field(factory=dict)

    def mean(self, name: str, value: float, weight: float = 1.0) -> None:
        """Records a value averaged across ranks, weighted by `weight` (e.g. sample count).

        Recording the same name twice on one rank folds both into the weighted mean.
        """
        value, weight = float(value), float(weight)
        if weight <= 0 or math.isnan(value):
            return
        if name in self._values:
            _, total, w = self._values[name]
            self._values[name] = ("mean", total + value * weight, w + weight)
        else:
            self._values[name] = ("mean", value * weight, weight)

    def sum(self, name: str, value: float) -> None:
        """Records a value summed across ranks (and across calls on one rank)."""
        prev = self._values.get(name, ("sum", 0.0, 1.0))[1]
        self._values[name] = ("sum", prev + float(value), 1.0)

    def max(self, name: str, value: float) -> None:
        """Records a value whose maximum across ranks is kept (e.g. phase times)."""
        prev = self._values.get(name, ("max", -math.inf, 1.0))[1]
        self._values[name] = ("max", max(prev, float(value)), 1.0)

    def min(self, name: str, value: float) -> None:
        """Records a value whose minimum across ranks is kept."""
        prev = self._values.get(name, ("min", math.inf, 1.0))[1]
        self._values[name] = ("min", min(prev, float(value)), 1.0)

    def add_engine_metrics(self, prefix: str, metrics: Mapping[str, Any], weight: float) -> None:
        """Records an engine's returned metrics as weighted means.

        Plain keys (`grad_norm`) are put under `prefix/`; keys that already carry a
        namespace (`actor/pg_loss`, `kl/mean`) are kept as they are.
        """
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                name = key if key.startswith(f"{prefix}/") or "/" in key else f"{prefix}/{key}"
                self.mean(name, value, weight)

    def raw(self) -> dict[str, tuple[str, float, float]]:
        """Returns `{name: (reduce, accumulated, weight)}` for the cross-rank exchange."""
        return dict(self._values)


def reduce_metrics(per_rank: list[Mapping[str, tuple[str, float, float]]]) -> dict[str, float]:
    """Combines the `StepMetrics.raw()` of every rank into one flat dict (sorted keys).

    Args:
        per_rank: One raw dict per rank, in rank order.

    Returns:
        `{name: value}`; a name recorded on only some ranks is reduced over those ranks.

    Raises:
        ValueError: two ranks recorded one name with different reductions.
    """
    merged: dict[str, tuple[str, float, float]] = {}
    for raw in per_rank:
        for name, (how, acc, weight) in raw.items():
            if name not in merged:
                merged[name] = (how, acc, weight)
                continue
            how0, acc0, w0 = merged[name]
            if how0 != how:
                raise ValueError(
                    f"metric {name!r} is reduced by {how0!r} on one rank and {how!r} on "
                    "another; record it with the same StepMetrics method everywhere."
                )
            if how == "mean" or how == "sum":
                merged[name] = (how, acc0 + acc, w0 + weight)
            elif how == "max":
                merged[name] = (how, max(acc0, acc), 1.0)
            else:
                merged[name] = (how, min(acc0, acc), 1.0)
    out: dict[str, float] = {}
    for name in sorted(merged):
        how, acc, weight = merged[name]
        out[name] = acc / weight if how == "mean" else acc
    return out


def all_reduce_metrics(metrics: StepMetrics, group: Any = None) -> dict[str, float]:
    """Exchanges every rank's metrics once and returns the same reduced dict on every rank.

    Args:
        metrics: This rank's step metrics.
        group: torch.distributed group (default world); with no process group initialised,
            the local metrics are reduced alone.
    """
    return MetricsExchange(group=group).reduce(metrics)


Layout = tuple[tuple[str, str], ...]
"""A rank's recorded metrics: `(name, reduction)` pairs, sorted by name."""


@attrs.define(eq=False)
class MetricsExchange:
    """Reduces step metrics across ranks, step after step (`reduce`, collective).

    The first step gathers every rank's `StepMetrics.raw()` as objects (`all_gather_values`,
    two collectives) and keeps each rank's layout. Later steps, while every rank records the
    names it recorded then, gather only the numbers: one fixed-size float64 tensor per
    rank, whose first entry says whether that rank's layout is still the kept one. If any
    rank's layout changed, the step falls back to the object gather and keeps the new
    layouts. Both paths hand `reduce_metrics` the same per-rank values (float64 holds a
    Python float exactly), so the reduced metrics are identical.
    """

    group: Any = None
    """torch.distributed group (None: world)."""
    _layouts: list[Layout] | None = attrs.field(default=None, init=False)

    def reduce(self, metrics: StepMetrics) -> dict[str, float]:
        """Every rank's metrics of this step, reduced; the same dict on every rank."""
        import torch.distributed as dist

        from peerflow.distributed.comm import all_gather_values

        raw = metrics.raw()
        if not (dist.is_available() and dist.is_initialized()):
            return reduce_metrics([raw])
        if self._layouts is not None:
            per_rank = self._gather_values(raw)
            if per_rank is not None:
                return reduce_metrics(per_rank)
        gathered = all_gather_values(raw, self.group, what="metrics: every rank's names")
        self._layouts = [_layout(r) for r in gathered]
        return reduce_metrics(gathered)

    def _gather_values(self, raw: dict[str, tuple[str, float, float]]
                       ) -> list[dict[str, tuple[str, float, float]]] | None:
        """The per-rank raw metrics from one tensor gather; None if a layout changed."""
        import torch
        import torch.distributed as dist

        from peerflow.distributed.comm import all_gather_tensor

        assert self._layouts is not None
        layout = _layout(raw)
        width = max(len(kept) for kept in self._layouts)
        row = torch.zeros(1 + 2 * width, dtype=torch.float64)  # host: gathered over gloo
        if layout == self._layouts[dist.get_rank(self.group)]:
            row[0] = 1.0
            row[1:1 + len(layout)] = torch.tensor([raw[n][1] for n, _ in layout],
                                                  dtype=torch.float64)
            row[1 + width:1 + width + len(layout)] = torch.tensor(
                [raw[n][2] for n, _ in layout], dtype=torch.float64)
        values = [r.tolist() for r in all_gather_tensor(row, self.group, what="step metrics")]
        if not all(v[0] == 1.0 for v in values):
            return None
        return [{name: (how, v[1 + i], v[1 + width + i]) for i, (name, how) in enumerate(kept)}
                for kept, v in zip(self._layouts, values, strict=True)]


def _layout(raw: dict[str, tuple[str, float, float]]) -> Layout:
    return tuple(sorted((name, how) for name, (how, _, _) in raw.items()))


#: Object field: per sample, `{reward name: its unweighted score}` (set by reward nodes).
REWARD_COMPONENTS = "reward_components"


def record_batch_metrics(batch: Batch, metrics: StepMetrics) -> None:
    """Records reward, length and token-count metrics of this rank's samples.

    `reward/<name>/mean` is each reward's mean over the samples it scored (NaN: an
    environment's reward it did not give), read from the samples' `reward_components` —
    here, on the trainer, so async runs (whose rewards run on the rollout ranks) log it
    too. `reward/failed_samples` counts the samples a reward failed on, and
    `reward/<name>/failed` those each reward failed on (`peerflow.worker.reward_watch`).

    `response_length/*` counts the tokens the model generated (a multi-turn
    trajectory's observation tokens, `loss_mask` false, left out); `tokens/response`
    counts every response token (what the engines processed, for throughput).
    """
    n = len(batch)
    if not n:
        return
    if "reward" in batch:
        reward = batch["reward"].float()
        metrics.mean("reward/mean", float(reward.mean()), n)
        metrics.mean("reward/_sq", float((reward**2).mean()), n)
        metrics.max("reward/max", float(reward.max()))
        metrics.min("reward/min", float(reward.min()))
    if REWARD_COMPONENTS in batch:
        _record_reward_components(batch[REWARD_COMPONENTS], metrics)
    if "score" in batch:
        metrics.mean("score/mean", float(batch["score"].float().mean()), n)
    if "response_ids" in batch:  # lengths count model tokens; tokens/* every token
        lengths = batch.trained_lengths().float()
        metrics.mean("response_length/mean", float(lengths.mean()), n)
        metrics.max("response_length/max", float(lengths.max()))
        metrics.sum("tokens/response", float(batch.lengths("response_ids").sum()))
    if "prompt_ids" in batch:
        metrics.sum("tokens/prompt", float(batch.lengths("prompt_ids").sum()))
        metrics.mean("prompt_length/mean", float(batch.lengths("prompt_ids").float().mean()), n)
    if "finish_reason" in batch:
        clipped = sum(1 for r in batch["finish_reason"] if r in TRUNCATED)
        metrics.mean("response_length/clip_frac", clipped / n, n)
    if "reward_errors" in batch:  # names of the rewards that failed on each sample
        names = batch["reward_errors"]
        metrics.sum("reward/failed_samples", sum(1 for failed in names if failed))
        for name in sorted({n for failed in names for n in failed}):
            metrics.sum(f"reward/{name}/failed", sum(name in failed for failed in names))
    if "num_turns" in batch:
        from peerflow.agents.rollout import record_episode_metrics

        record_episode_metrics(batch, metrics)
    metrics.sum("samples", n)


def _record_reward_components(rows: list[dict[str, float]], metrics: StepMetrics) -> None:
    for name in sorted({name for row in rows for name in row}):
        given = [row[name] for row in rows if not math.isnan(row.get(name, math.nan))]
        if given:
            metrics.mean(f"reward/{name}/mean", sum(given) / len(given), len(given))


def finish_metrics(reduced: dict[str, float], step: int) -> dict[str, float]:
    """Derives the metrics that need cross-rank totals (std, throughput) and adds `step`."""
    out = dict(reduced)
    if "reward/_sq" in out:
        mean = out.get("reward/mean", 0.0)
        out["reward/std"] = max(out.pop("reward/_sq") - mean * mean, 0.0) ** 0.5
    if "advantages/_sq" in out:
        mean = out.get("advantages/mean", 0.0)
        out["advantages/std"] = max(out.pop("advantages/_sq") - mean * mean, 0.0) ** 0.5
    tokens = out.get("tokens/prompt", 0.0) + out.get("tokens/response", 0.0)
    out["tokens/total"] = tokens
    step_s = out.get("time/step", 0.0)
    if step_s > 0:
        out["throughput/tokens_per_s"] = tokens / step_s
        out["throughput/samples_per_s"] = out.get("samples", 0.0) / step_s
    return {"step": step, **dict(sorted(out.items()))}


@attrs.define
class SignalWatch:
    """Warns when a step had no learning signal: every group's rewards were equal.

    The reporting rank calls `check` with each step's reduced metrics; it warns on the
    first such step and then at most once every `every` steps.
    """

    every: int = 10
    _last: int | None = None

    def check(self, step: int, reduced: Mapping[str, float]) -> bool:
        """Warns when `reward/frac_zero_std` is 1; returns whether it warned."""
        if reduced.get("reward/frac_zero_std") != 1.0:
            return False
        if self._last is not None and step - self._last < self.every:
            return False
        self._last = step
        log.warning(
            "step %d: every prompt's answers got the same reward (reward/frac_zero_std = 1), "
            "so group-relative advantages are all 0 and the step trains nothing. Make the "
            "reward denser (partial credit) or the task easier, raise rollout.sampling.n or "
            "the temperature, or set algorithm.dynamic_sampling: true.", step)
        return True
