"""Bounded-staleness admission and step assignment for one rollout dp-rank.

Staleness is counted in weight versions. Training step `s` starts from trainer weights of
version `s` (the trainer publishes version `s + 1` after it), so a sample generated under
version `v` and trained in step `s` is `s - v` versions stale. With `max_staleness = K`
every sample must be trained in a step `s <= v + K`: its *deadline*.

Two rules keep every deadline without ever dropping finished work:

1. **Admission** (`can_admit`): a rollout rank starts a new prompt under version `v` only
   while `trainer_version - v <= K` and the slots left in steps `next_step … s'` can still
   hold every unassigned group whose deadline is at most `s'`, for every `s'` (Hall's
   condition for earliest-deadline-first scheduling of unit jobs).
2. **Assignment** (`assign_finished`): finished groups fill the rank's open step in
   earliest-deadline order, and a group is placed only while Hall's condition still holds
   for the groups left behind. A step is *sealed* when it holds the rank's `quota` groups.

Because every rank contributes exactly `quota` groups to every step, the trainer's steps
are complete once every rollout rank has sealed them; no central store is consulted.
With `K = 0` step `s` holds exactly the `quota` prompts admitted under version `s`, in
admission order, which is what synchronous on-policy training does.

All methods are local and O(groups in flight); the scheduler never talks to peers.
"""

from __future__ import annotations

from collections import Counter

import attrs

from peerflow.checkpoint.state import JsonState
from peerflow.errors import ConfigError


class StalenessError(RuntimeError):
    """A caller broke the admission protocol (admitted without `can_admit`, unknown id)."""


def _non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name}={value}: must be 0 or more "
            "(runtime.max_staleness counts weight versions; 0 is on-policy)."
        )


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name}={value}: must be at least 1 "
            "(each rollout rank contributes at least one prompt group to every step)."
        )


@attrs.frozen(kw_only=True)
class StepAssignment:
    """A finished group placed into a training step."""

    group_id: int
    """The prompt group's id."""
    step: int
    """The training step (= trainer weight version it is trained from)."""
    version: int
    """Weight version the group was admitted (started generating) under."""

    @property
    def staleness(self) -> int:
        """How many versions the trainer is ahead of the group's oldest tokens."""
        return self.step - self.version


@attrs.define(eq=False)
class StalenessScheduler(JsonState):
    """Admission control and earliest-deadline step assignment for one rollout dp-rank.

    Call sequence, on the rollout rank only:

    1. `can_admit(rollout_version, trainer_version)` → `admit(group_id, rollout_version)`
       for every prompt the rank starts generating.
    2. `finish(group_id)` when all answers of the group are generated.
    3. `assign_finished()` → `StepAssignment`s to stream to the trainers;
       `sealed_steps()` tells which steps this rank has completed.
    """

    max_staleness: int = attrs.field(validator=_non_negative)
    """Most versions a sample may lag the trainer by (`runtime.max_staleness`)."""
    quota: int = attrs.field(validator=_positive)
    """Groups this rank contributes to every training step."""
    next_step: int = 0
    """Lowest step this rank has not sealed yet (the open step)."""
    filled: int = 0
    """Groups already placed in `next_step`."""
    in_flight: dict[int, int] = attrs.field(factory=dict)
    """Admitted, still generating: group id → admission version."""
    finished: dict[int, int] = attrs.field(factory=dict)
    """Finished, not yet placed in a step: group id → admission version."""

    def deadline(self, version: int) -> int:
        """The last step a group admitted under `version` may be trained in."""
        return version + self.max_staleness

    def _hall_ok(self, versions: list[int], filled: int, next_step: int) -> bool:
        if not versions:
            return True
        counts = Counter(self.deadline(v) for v in versions)
        if min(counts) < next_step:
            return False
        pending = 0
        for step in range(next_step, max(counts) + 1):
            pending += counts.get(step, 0)
            if pending > (self.quota - filled) + (step - next_step) * self.quota:
                return False
        return True

    def _unassigned_versions(self) -> list[int]:
        return [*self.in_flight.values(), *self.finished.values()]

    def can_admit(self, rollout_version: int, trainer_version: int | None = None) -> bool:
        """Whether a new prompt may start generating under `rollout_version`.

        Args:
            rollout_version: Weight version loaded in this rank's engine.
            trainer_version: Latest trainer version this rank has heard of; defaults to
                `next_step`, a lower bound (the trainer cannot be past an unsealed step).

        Returns:
            `True` while `trainer_version - rollout_version <= max_staleness` and the new
            group's deadline can still be met without dropping work.
        """
        trainer_version = self.next_step if trainer_version is None else trainer_version
        if trainer_version - rollout_version > self.max_staleness:
            return False
        return self._hall_ok(
            [*self._unassigned_versions(), rollout_version], self.filled, self.next_step
        )

    def admit(
        self, group_id: int, rollout_version: int, trainer_version: int | None = None
    ) -> None:
        """Records that prompt group `group_id` starts generating under `rollout_version`.

        Raises:
            StalenessError: the group is already known, or `can_admit` is false.
        """
        if group_id in self.in_flight or group_id in self.finished:
            raise StalenessError(f"group {group_id} was admitted twice; group ids must be unique.")
        if not self.can_admit(rollout_version, trainer_version):
            raise StalenessError(
                f"group {group_id} admitted under version {rollout_version} would break "
                f"max_staleness={self.max_staleness} (open step {self.next_step}); call "
                "can_admit() first and wait for new weights when it is false."
            )
        self.in_flight[group_id] = rollout_version

    def finish(self, group_id: int) -> None:
        """Marks an admitted group as fully generated.

        Raises:
            StalenessError: `group_id` is not in flight.
        """
        try:
            self.finished[group_id] = self.in_flight.pop(group_id)
        except KeyError:
            raise StalenessError(
                f"group {group_id} finished but is not in flight on this rank "
                f"(in flight: {sorted(self.in_flight)[:8]}…)."
            ) from None

    def assign_finished(self) -> list[StepAssignment]:
        """Places finished groups into steps, earliest deadline first, while it is safe.

        Returns:
            The new assignments in placement order (possibly spanning several steps).
        """
        placed: list[StepAssignment] = []
        while self.finished:
            group_id, version = min(self.finished.items(), key=lambda kv: (kv[1], kv[0]))
            rest = [v for g, v in self.finished.items() if g != group_id]
            rest += list(self.in_flight.values())
            filled, step = self.filled + 1, self.next_step
            if filled == self.quota:
                filled, step = 0, step + 1
            if self.deadline(version) < self.next_step or not self._hall_ok(rest, filled, step):
                break
            del self.finished[group_id]
            placed.append(StepAssignment(group_id=group_id, step=self.next_step, version=version))
            self.filled, self.next_step = filled, step
        return placed

    def sealed_steps(self) -> int:
        """Number of steps this rank has completely filled (steps `0 … n-1`)."""
        return self.next_step
