"""`RewardSet`: the rewards of a run (one or several, weighted), scoring a batch of answers.

A component is either a function named by reference (`rewards.py:score`, `pkg.mod:fn`, or
a registered reward class that declares `function`) — run in the `RewardPool` under time
and memory limits — or a registered `RewardFunction` class, called in the rank's own
process. Either way a failure costs only the samples it touched: they score
`failure_score`, are marked in `RewardScores.failed` (what training does with them:
`task.reward_limits.on_failure`, `peerflow.algorithms.failed_samples`), are counted in
`reward/errors` or `reward/timeouts`, are logged with the reward's name, the sample and
the settings that decide their fate, and come back as `RewardScores.errors` (with the
traceback) for `RUN_DIR/reward_errors.jsonl`. A batched call that raises (or a
`RewardFunction.score` that does) is retried one sample at a time, so only the samples
it really fails on lose their score.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from typing import Any

import attrs

from peerflow.outputs.terminal import escape_control
from peerflow.rewards.loading import RewardShape
from peerflow.rewards.pool import (
    Outcome,
    RewardPool,
    call_reward,
    failed,
    to_outcome,
    user_traceback,
)

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
class RewardError:
    """One sample a reward failed on (a line of `RUN_DIR/reward_errors.jsonl`)."""

    reward: str
    """The reward's name (`reward/<name>/...`)."""
    sample_id: int
    prompt_index: Any
    """The dataset row of the sample's prompt (`Example.index`)."""
    status: str
    """`error` or `timeout`."""
    message: str
    traceback: str = ""
    """The reward's traceback when it raised (empty for a bad value or a time-out)."""


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
    errors: list[RewardError] = attrs.field(factory=list)
    """Every (component, sample) failure, in component order."""


#: What `task.reward_limits.on_failure` does with a failed sample, for messages.
FATES = {"train": "trained at that score", "mask": "left out of training",
         "drop_group": "left out of training with their whole group"}


@attrs.frozen(kw_only=True)
class _Call:
    """One started call of a component: its samples and what will say how it went."""

    indices: list[int]
    """Positions in the batch of the samples it scores."""
    pending: Any
    """A pool `Future`, or the outcomes computed right away."""
    batched: bool = False
    """Retry it one sample at a time if it fails as a whole."""


@attrs.define(eq=False)
class RewardSet:
    """Scores answers with weighted rewards; never raises for a reward's own failure."""

    components: list[RewardComponent]
    failure_score: float = 0.0
    pool: RewardPool | None = None
    """Runs function rewards; `None` calls them in this process (no limits)."""
    on_failure: str = "train"
    """`task.reward_limits.on_failure`, named in failure messages."""

    def score(self, responses: Sequence[str], examples: Sequence[Any],
              sample_ids: Sequence[int] | None = None, *,
              context: dict[str, Any] | None = None) -> RewardScores:
        """Scores `responses` (one per example) with every component.

        Args:
            responses: Decoded answers.
            examples: The `Example` (or record dict) each answer responds to.
            sample_ids: Names the samples in failure logs (default: positions).
            context: What TRL-style rewards get beside the rows: `completion_ids` (one
                list per answer), `step` and `steps` (`peerflow.rewards.trl_style`).
        """
        if len(responses) != len(examples):
            raise ValueError(f"scoring {len(responses)} responses for {len(examples)} "
                             "examples; the reward node must pass one example per response.")
        ids = list(sample_ids) if sample_ids is not None else list(range(len(responses)))
        records = [example_record(e) for e in examples]
        batch = _Batch(responses=list(responses), examples=list(examples), records=records,
                       context=context)
        pending = [(c, self._submit(c, batch, list(range(len(responses)))))
                   for c in self.components]
        total = [0.0] * len(responses)
        metrics: dict[str, tuple[float, int]] = {}
        counts = {"reward/errors": 0, "reward/timeouts": 0}
        failed = [False] * len(responses)
        components: dict[str, list[float]] = {}
        errors: list[RewardError] = []
        for component, calls in pending:
            found = self._collect(component, batch, calls)
            outcomes = [found[i] for i in range(len(responses))]
            for i, outcome in enumerate(outcomes):
                failed[i] = failed[i] or outcome.status != "ok"
            scores = self._account(component, outcomes, ids, records, counts, errors)
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
                            components=components, errors=errors)

    def _submit(self, component: RewardComponent, batch: _Batch, indices: list[int]
                ) -> list[_Call]:
        """Starts a component on the samples at `indices`."""
        if component.ref is None:
            return [_Call(indices=indices, batched=len(indices) > 1,
                          pending=_call_function(component, batch, indices))]
        batched = component.shape.batched if component.shape is not None else None
        groups = [indices] if batched else [[i] for i in indices]
        if self.pool is None:  # `reward_limits.workers: 0`: in this process, no limits
            return [_Call(indices=g, batched=len(g) > 1,
                          pending=_call_ref(component.ref, batched, batch, g)) for g in groups]
        return [_Call(indices=g, batched=len(g) > 1,
                      pending=self.pool.submit(component.ref, batched, *batch.take(g)))
                for g in groups]

    def _collect(self, component: RewardComponent, batch: _Batch, calls: list[_Call]
                 ) -> dict[int, Outcome]:
        """Waits for the calls; a batched call that raised is scored again per sample.

        Returns:
            The outcome of each sample the calls scored, by its position in the batch.
        """
        outcomes: dict[int, Outcome] = {}
        for call in calls:
            result = self._wait(call.pending)
            if isinstance(result, Outcome) and result.status == "error" and call.batched:
                log.warning("reward %r raised on a batch of %d (%s); scoring those samples "
                            "one at a time to find the ones it fails on", component.name,
                            len(call.indices), escape_control(result.message))
                retried = [c for i in call.indices for c in self._submit(component, batch, [i])]
                result = self._collect(component, batch, retried)
                result = [result[i] for i in call.indices]
            elif isinstance(result, Outcome):
                result = [result] * len(call.indices)
            for i, outcome in zip(call.indices, result):
                outcomes[i] = outcome
        return outcomes

    def _wait(self, pending: Any) -> list[Outcome] | Outcome:
        """The outcomes of a call, or one `Outcome` when the call failed as a whole."""
        if isinstance(pending, (list, Outcome)):
            return pending
        assert self.pool is not None
        try:
            return pending.result()
        except BaseException as exc:  # noqa: BLE001 - every failure is scored, none hangs
            if isinstance(exc, KeyboardInterrupt):
                raise
            return failed(exc, self.pool.timeout_s, self.pool.memory_mb)

    def close(self) -> None:
        """Stops the reward pool."""
        if self.pool is not None:
            self.pool.close()

    def _account(self, component: RewardComponent, outcomes: list[Outcome], ids: list[int],
                 records: list[dict[str, Any]], counts: dict[str, int],
                 errors: list[RewardError]) -> list[float]:
        scores, failures = [], []
        for outcome, sample, record in zip(outcomes, ids, records):
            if outcome.status == "ok":
                scores.append(outcome.score)
                continue
            scores.append(self.failure_score)
            counts["reward/timeouts" if outcome.status == "timeout" else "reward/errors"] += 1
            failures.append(f"sample {sample} (prompt #{record.get('index')}): "
                            f"{escape_control(outcome.message)}")
            errors.append(RewardError(reward=component.name, sample_id=int(sample),
                                      prompt_index=record.get("index"), status=outcome.status,
                                      message=outcome.message, traceback=outcome.traceback))
        if failures:
            where = component.ref or type(component.function).__name__
            shown = "\n  ".join(failures[:LOGGED_FAILURES])
            more = len(failures) - LOGGED_FAILURES
            log.warning(
                "reward %r (%s) failed on %d of %d samples; they score "
                "task.reward_limits.failure_score=%g and are %s "
                "(task.reward_limits.on_failure=%s; mask or drop_group leave them out). "
                "Tracebacks: reward_errors.jsonl in the run directory.\n  %s%s",
                component.name, where, len(failures), len(outcomes), self.failure_score,
                FATES.get(self.on_failure, self.on_failure), self.on_failure, shown,
                f"\n  … and {more} more" if more > 0 else "")
        return scores


@attrs.frozen(kw_only=True)
class _Batch:
    """The answers being scored and what each component call takes from them."""

    responses: list[str]
    examples: list[Any]
    records: list[dict[str, Any]]
    context: dict[str, Any] | None = None

    def take(self, indices: list[int]) -> tuple[list[str], list[dict[str, Any]],
                                                 dict[str, Any] | None]:
        """`(responses, records, context)` of the samples at `indices`."""
        context = self.context
        if context is not None and context.get("completion_ids") is not None:
            ids = context["completion_ids"]
            context = {**context, "completion_ids": [ids[i] for i in indices]}
        return ([self.responses[i] for i in indices], [self.records[i] for i in indices],
                context)


def _failure(exc: Exception) -> Outcome:
    return Outcome(status="error", message=f"{type(exc).__name__}: {exc}",
                   traceback=user_traceback(traceback.format_exc()))


def _call_ref(ref: str, batched: bool | None, batch: _Batch, indices: list[int]
              ) -> list[Outcome] | Outcome:
    """Calls a function reward in this process (`reward_limits.workers: 0`).

    Returns one `Outcome` when the call raised as a whole.
    """
    try:
        return call_reward(ref, batched, *batch.take(indices))
    except Exception as exc:  # noqa: BLE001 - a reward's failure is scored, not raised
        return _failure(exc)


def _call_function(component: RewardComponent, batch: _Batch, indices: list[int]
                   ) -> list[Outcome] | Outcome:
    """Calls a registered `RewardFunction` in this process; a raise fails the whole call."""
    function = component.function
    try:
        values = list(function.score([batch.responses[i] for i in indices],
                                     [batch.examples[i] for i in indices]))
    except Exception as exc:  # noqa: BLE001
        return _failure(exc)
    if len(values) != len(indices):
        return [Outcome(status="error", message=(
            f"{type(function).__name__}.score returned {len(values)} scores for "
            f"{len(indices)} answers; return one per answer"))] * len(indices)
    return [to_outcome(v, component.name) for v in values]
