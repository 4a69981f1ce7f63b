"""Trainer-side buffering: per-sample fields, micro-batches as soon as one is full.

A trainer dp-rank receives whole prompt groups from rollout ranks, in any order, tagged
with the training step they belong to. `MicroBatchAccumulator` holds one step's samples.
A sample is *ready* once every required field is present; the sampler forms micro-batches
from ready samples
and `pop_ready` hands out each one as soon as it is full, so per-micro-batch work
(reference / old log-prob forwards) overlaps with the rest of the step still streaming in.

`StepInbox` knows when a step is complete: every rollout rank sends, after its last group
for a step, a *seal* carrying how many groups it sent this trainer for that step.
"""

from __future__ import annotations

import attrs

from peerflow.batch import Batch
from peerflow.streaming.samplers import MicroBatchBudget, PooledSample, Sampler


@attrs.frozen
class _Buffered:
    """Where a buffered sample lives: row `row` of the group batch it arrived in."""

    batch: Batch
    row: int
    group_id: int
    tokens: int


@attrs.define(eq=False)
class MicroBatchAccumulator:
    """One trainer dp-rank's samples of the current step.

    Call sequence: `add(group_batch)` as messages arrive; `pop_ready()` after each
    (returns zero or more full micro-batches); once the step is complete,
    `pop_ready(final=True)` returns the remainder. Every added sample is returned exactly
    once. Samples stay rows of the batch they arrived in until they are handed out, so a
    micro-batch costs one row selection per arrived batch, not one per sample.
    """

    sampler: Sampler
    budget: MicroBatchBudget
    required_fields: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Fields a sample needs before it may be trained on (e.g. `reward`, `ref_logprobs`)."""
    token_fields: tuple[str, ...] = ("prompt_ids", "response_ids")
    """Ragged fields whose lengths count as a sample's tokens."""
    _samples: dict[int, _Buffered] = attrs.field(factory=dict, init=False)
    _arrival: list[int] = attrs.field(factory=list, init=False)
    _emitted: set[int] = attrs.field(factory=set, init=False)

    def add(self, batch: Batch) -> None:
        """Buffers the samples of `batch` (usually one prompt group).

        Raises:
            ValueError: a sample id is already buffered or was already emitted.
        """
        tokens = batch.token_count(self.token_fields).tolist()
        groups = batch.group_id.tolist()
        for row, sid in enumerate(batch.sample_id.tolist()):
            if sid in self._samples or sid in self._emitted:
                raise ValueError(
                    f"sample {sid} (group {groups[row]}) reached this trainer "
                    "twice; a rollout rank resent it, which would train on it twice."
                )
            self._samples[sid] = _Buffered(batch=batch, row=row, group_id=groups[row],
                                           tokens=tokens[row])
            self._arrival.append(sid)

    def _ready(self, sid: int) -> bool:
        fields = self._samples[sid].batch.fields
        return all(name in fields for name in self.required_fields)

    @property
    def pending(self) -> int:
        """Samples buffered and not yet handed out (the queue depth)."""
        return len(self._arrival)

    def _take(self, ids: list[int]) -> Batch:
        """Removes samples `ids` and returns them as one batch, in that order."""
        parts: list[Batch] = []
        run: list[int] = []
        source: Batch | None = None
        for sid in ids:
            held = self._samples.pop(sid)
            if run and held.batch is not source:
                parts.append(source.select(run))
                run = []
            source = held.batch
            run.append(held.row)
        if run:
            parts.append(source.select(run))
        return parts[0] if len(parts) == 1 else Batch.concat(parts)

    def pop_ready(self, final: bool = False) -> list[Batch]:
        """Returns every micro-batch that is full now (all remaining ones if `final`).

        Raises:
            ValueError: `final` while some sample still lacks a required field.
        """
        ready = [sid for sid in self._arrival if self._ready(sid)]
        if final and len(ready) < len(self._arrival):
            missing = {
                sid: [n for n in self.required_fields
                      if n not in self._samples[sid].batch.fields]
                for sid in self._arrival
                if sid not in ready
            }
            raise ValueError(
                f"step ended but samples lack required fields: {dict(list(missing.items())[:4])}; "
                "the node producing them did not run or sent to the wrong trainer."
            )
        out: list[Batch] = []
        while ready:
            pool = [
                PooledSample(sample_id=sid, group_id=self._samples[sid].group_id,
                             tokens=self._samples[sid].tokens)
                for sid in ready
            ]
            chosen = self.sampler.select(pool, self.budget, final)
            if not chosen:
                break
            ids = [ready[i] for i in chosen]
            out.append(self._take(ids))
            self._emitted.update(ids)
            taken = set(ids)
            ready = [sid for sid in ready if sid not in taken]
            self._arrival = [sid for sid in self._arrival if sid not in taken]
        return out

    def reset(self) -> None:
        """Forgets emitted ids; call between steps once the step's samples are trained."""
        self._emitted.clear()


@attrs.define(eq=False)
class StepInbox:
    """Tracks which rollout ranks have sealed which steps for one trainer dp-rank."""

    sources: tuple[int, ...] = attrs.field(converter=tuple)
    """Global ranks of the rollout dp-ranks that send to this trainer."""
    received: dict[tuple[int, int], int] = attrs.field(factory=dict)
    """(step, source) → groups received."""
    sealed: dict[tuple[int, int], int] = attrs.field(factory=dict)
    """(step, source) → groups the source says it sent."""

    def on_group(self, step: int, source: int, count: int = 1) -> None:
        """Counts `count` groups received from `source` for `step` (one message)."""
        self.received[(step, source)] = self.received.get((step, source), 0) + count

    def on_seal(self, step: int, source: int, count: int) -> None:
        """Records `source`'s seal of `step` (it sent `count` groups here)."""
        self.sealed[(step, source)] = int(count)

    def complete(self, step: int) -> bool:
        """Whether every source sealed `step` and all its groups have arrived."""
        return all(
            (step, s) in self.sealed and self.received.get((step, s), 0) == self.sealed[(step, s)]
            for s in self.sources
        )

    def forget(self, step: int) -> None:
        """Drops the bookkeeping of a trained step."""
        for s in self.sources:
            self.received.pop((step, s), None)
            self.sealed.pop((step, s), None)
