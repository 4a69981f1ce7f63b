"""`RewardSet`: the rewards of a run (one or several, weighted), scoring a batch of answers.

A component is either a function named by reference (`rewards.py:score`, `pkg.mod:fn`, or
a registered reward class that declares `function`) — run in the `RewardPool` under time
and memory limits — or a registered `RewardFunction` class, called in the rank's own
process. Either way a failure costs only the samples it touched: they score
`failure_score`, are marked in `RewardScores.failed` (what training does with them:
`task.reward_limits.on_failure`, `peerflow.algorithms.failed_samples`), are counted in
`reward/errors` or `reward/timeouts`, and are logged with the reward's name and the
sample.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs

from peerflow.rewards.loading import RewardShape
from peerflow.rewards.pool import Outcome, RewardPool, call_reward, to_outcome

log = logging.getLogger("peerflow.rewards")

#: Failures logged one by one per component and call; the rest are summarised.
LOGGED_FAILURES = 5


def example_record(example: Any) -> dict[str, Any]:
    """The plain dict a function reward receives as `example`.

    Keys: `prompt`, `answer`, `index`, plus every other column of a dataset row
    (`data_source`, `extra_info`, …).
    """
    if isinstance(example, dict):
        return example
    record = dict(getattr(example, "metadata", None) or {})
    record.update(prompt=example.prompt, answer=example.answer, index=example.index)
    return record


@attrs.frozen(kw_only=True)
class RewardComponent:
    """One reward of a `RewardSet`."""

    name: str
    """Metric name (`reward/<name>/mean`)."""
    weight: float = 1.0
    ref: str | None = None
    """`source:function` run in the pool, or `None` for an in-process `function`."""
    shape: RewardShape | None = None
    """How `ref` is called (known after loading it)."""
    function: Any = None
    """A `RewardFunction` instance called in-process (when `ref` is `None`)."""


@attrs.frozen(kw_only=True)
class RewardScores:
    """What scoring one batch produced."""

    total: list[float]
    """The weighted sum of the components, one per answer."""
    metrics: dict[str, tuple[float, int]]
    """Means as `(value, count)`: `reward/<name>/mean` and extras per component."""
    counts: dict[str, int]
    """`reward/errors` and `reward/timeouts`."""
    failed: list[bool]
    """Per answer: a component failed on it (it scored `failure_score` there)."""
    components: dict[str, list[float]] = attrs.field(factory=dict)
    """Per component name: its unweighted score of each answer."""


@attrs.define(eq=False)
class RewardSet:
    """Scores answers with weighted rewards; never raises for a reward's own failure."""

    components: list[RewardComponent]
    failure_score: float = 0.0
    pool: RewardPool | None = None
    """Runs function rewards; `None` calls them in this process (no limits)."""

    def score(self, responses: Sequence[str], examples: Sequence[Any],
              sample_ids: Sequence[int] | None = None) -> RewardScores:
        """Scores `responses` (one per example) with every component.

        Args:
            responses: Decoded answers.
            examples: The `Example` (or record dict) each answer responds to.
            sample_ids: Names the samples in failure logs (default: positions).
        """
        if len(responses) != len(examples):
            raise ValueError(f"scoring {len(responses)} responses for {len(examples)} "
                             "examples; the reward node must pass one example per response.")
        ids = list(sample_ids) if sample_ids is not None else list(range(len(responses)))
        records = [example_record(e) for e in examples]
        pending = [(c, self._submit(c, responses, examples, records)) for c in self.components]
        total = [0.0] * len(responses)
        metrics: dict[str, tuple[float, int]] = {}
        counts = {"reward/errors": 0, "reward/timeouts": 0}
        failed = [False] * len(responses)
        components: dict[str, list[float]] = {}
        for component, handle in pending:
            outcomes = self._collect(handle)
            for i, outcome in enumerate(outcomes):
                failed[i] = failed[i] or outcome.status != "ok"
            scores = self._account(component, outcomes, ids, records, counts)
            components[component.name] = list(scores)
            for i, value in enumerate(scores):
                total[i] += component.weight * value
            if scores:
                metrics[f"reward/{component.name}/mean"] = (sum(scores) / len(scores),
                                                             len(scores))
            for key in sorted({k for o in outcomes for k in o.extras}):
                values = [o.extras[key] for o in outcomes if key in o.extras]
                metrics[f"reward/{component.name}/{key}"] = (sum(values) / len(values),
                                                             len(values))
        return RewardScores(total=total, metrics=metrics, counts=counts, failed=failed,
                            components=components)

    def _submit(self, component: RewardComponent, responses: Sequence[str],
                examples: Sequence[Any], records: list[dict[str, Any]]) -> Any:
        """Starts a component: futures from the pool, or outcomes computed right here."""
        if component.ref is None:
            return _call_function(component, responses, examples)
        batched = component.shape.batched if component.shape is not None else None
        if self.pool is None:
            return _call_ref(component.ref, batched, responses, records)
        if batched:
            return [(self.pool.submit(component.ref, True, responses, records),
                     len(responses))]
        return [(self.pool.submit(component.ref, False, [r], [e]), 1)
                for r, e in zip(responses, records)]

    def _collect(self, handle: Any) -> list[Outcome]:
        """Waits for what `_submit` started."""
        if handle and isinstance(handle[0], Outcome):
            return handle
        assert self.pool is not None
        return [o for future, size in handle for o in self.pool.outcomes(future, size)]

    def close(self) -> None:
        """Stops the reward pool."""
        if self.pool is not None:
            self.pool.close()

    def _account(self, component: RewardComponent, outcomes: list[Outcome], ids: list[int],
                 records: list[dict[str, Any]], counts: dict[str, int]) -> list[float]:
        scores, failures = [], []
        for outcome, sample, record in zip(outcomes, ids, records):
            if outcome.status == "ok":
                scores.append(outcome.score)
                continue
            scores.append(self.failure_score)
            counts["reward/timeouts" if outcome.status == "timeout" else "reward/errors"] += 1
            failures.append(f"sample {sample} (prompt #{record.get('index')}): "
                            f"{outcome.message}")
        if failures:
            where = component.ref or type(component.function).__name__
            shown = "\n  ".join(failures[:LOGGED_FAILURES])
            more = len(failures) - LOGGED_FAILURES
            log.warning("reward %r (%s) failed on %d of %d samples, scored %g:\n  %s%s",
                        component.name, where, len(failures), len(outcomes),
                        self.failure_score, shown, f"\n  … and {more} more" if more > 0
                        else "")
        return scores


def _failure(exc: Exception) -> Outcome:
    return Outcome(status="error", message=f"{type(exc).__name__}: {exc}")


def _call_ref(ref: str, batched: bool | None, responses: Sequence[str],
              records: list[dict[str, Any]]) -> list[Outcome]:
    """Calls a function reward in this process (`reward_limits.workers: 0`).

    Per sample when it is not batched, so one bad sample costs one score.
    """
    if batched:
        try:
            return call_reward(ref, True, responses, records)
        except Exception as exc:  # noqa: BLE001 - a reward's failure is scored, not raised
            return [_failure(exc)] * len(responses)
    outcomes = []
    for response, record in zip(responses, records):
        try:
            outcomes += call_reward(ref, False, [response], [record])
        except Exception as exc:  # noqa: BLE001
            outcomes.append(_failure(exc))
    return outcomes


def _call_function(component: RewardComponent, responses: Sequence[str],
                   examples: Sequence[Any]) -> list[Outcome]:
    """Calls a registered `RewardFunction` in this process; a raise fails the whole call."""
    function = component.function
    try:
        values = list(function.score(list(responses), list(examples)))
    except Exception as exc:  # noqa: BLE001
        return [_failure(exc)] * len(responses)
    if len(values) != len(responses):
        return [Outcome(status="error", message=(
            f"{type(function).__name__}.score returned {len(values)} scores for "
            f"{len(responses)} answers; return one per answer"))] * len(responses)
    return [to_outcome(v, component.name) for v in values]
