"""`RewardWatch`: a reward that fails on everything stops the run; the run's failures tallied.

The run driver calls `check` on every rank of the schedule with each step's reduced
metrics (the same dict everywhere, so every rank decides alike):

* `reward/<name>/failed` equal to `samples` (every trained sample) for
  `task.reward_limits.fatal_after_steps` steps in a row raises `RewardFailedError`,
  naming the reward, one sample and its traceback (from `RUN_DIR/reward_errors.jsonl`,
  `peerflow.outputs.reward_errors`);
* `reward/failed_samples` and `samples` add up to the run's tally. `finish` (after the
  last step and its checkpoint) prints it on the reporting rank, writes
  `reward_errors.json` there, and raises `RewardFailedError` on every rank when the
  share of failed samples exceeds `task.reward_limits.max_failure_share`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from peerflow.algorithms.base import dataset_row
from peerflow.errors import PeerFlowError

log = logging.getLogger("peerflow.worker")


class RewardFailedError(PeerFlowError):
    """A reward failed on every sample for several steps, or on too many over the run."""


@attrs.define(eq=False)
class RewardWatch:
    """Follows each step's reward failures (see the module docstring)."""

    run_dir: Path
    fatal_after_steps: int = 3
    """`task.reward_limits.fatal_after_steps` (0: never stop)."""
    max_failure_share: float = 0.5
    """`task.reward_limits.max_failure_share`."""
    samples: float = 0.0
    """Samples trained so far (this run, from its first step or the resume)."""
    failed: float = 0.0
    """Of them, the ones a reward failed on."""
    by_reward: dict[str, float] = attrs.field(factory=dict)
    _streaks: dict[str, int] = attrs.field(factory=dict)

    @classmethod
    def from_config(cls, config: Any, run_dir: Path) -> RewardWatch:
        """The watch of a run (`task.reward_limits`)."""
        limits = config.task.reward_limits
        return cls(run_dir=Path(run_dir), fatal_after_steps=limits.fatal_after_steps,
                   max_failure_share=limits.max_failure_share)

    def check(self, step: int, reduced: Mapping[str, float]) -> None:
        """Adds a step's failures; raises when a reward failed on everything too long.

        Raises:
            RewardFailedError: a reward failed on every sample of the last
                `fatal_after_steps` steps.
        """
        samples = float(reduced.get("samples", 0.0))
        self.samples += samples
        self.failed += float(reduced.get("reward/failed_samples", 0.0))
        names = {k[len("reward/"):-len("/failed")] for k in reduced
                 if k.startswith("reward/") and k.endswith("/failed")} | set(self._streaks)
        for name in sorted(names):
            count = float(reduced.get(f"reward/{name}/failed", 0.0))
            self.by_reward[name] = self.by_reward.get(name, 0.0) + count
            everything = samples > 0 and count >= samples
            self._streaks[name] = self._streaks.get(name, 0) + 1 if everything else 0
            if self.fatal_after_steps and self._streaks[name] >= self.fatal_after_steps:
                raise RewardFailedError(self._stop_message(name, step))

    def _stop_message(self, name: str, step: int) -> str:
        from peerflow.outputs.reward_errors import ERRORS_FILE, last_reward_error

        error = last_reward_error(self.run_dir, name)
        steps = self._streaks[name]
        where = ("" if error is None else
                 f" Sample {error['sample_id']} ({dataset_row(error['prompt_index'])}): "
                 f"{error['message']}\n{error.get('traceback') or '(no traceback)'}")
        return (f"reward {name!r} failed on every sample of the last {steps} steps (up to "
                f"step {step}), so the run would learn nothing from it; stopping.{where}\n"
                f"Every failure is in {self.run_dir / ERRORS_FILE}. Fix the reward (run it "
                "on one row of the dataset by hand), or raise "
                "task.reward_limits.fatal_after_steps (0: never stop).")

    def tally(self) -> dict[str, Any]:
        """The run's reward failures: counts, share, per reward, and the limit."""
        share = self.failed / self.samples if self.samples else 0.0
        return {"samples": int(self.samples), "failed_samples": int(self.failed),
                "share": share, "by_reward": {k: int(v) for k, v in sorted(
                    self.by_reward.items())},
                "max_failure_share": self.max_failure_share,
                "exceeded": share > self.max_failure_share}

    def finish(self, *, reports: bool) -> None:
        """Prints and writes the tally (reporting rank); raises past the allowed share.

        Raises:
            RewardFailedError: more than `max_failure_share` of the trained samples had a
                reward fail on them (on every rank of the schedule).
        """
        from peerflow.outputs.reward_errors import ERRORS_FILE, TALLY_FILE, write_tally

        tally = self.tally()
        if reports:
            write_tally(self.run_dir, tally)
            if tally["failed_samples"]:
                per = ", ".join(f"{k}: {v}" for k, v in tally["by_reward"].items())
                log.warning("reward errors: %d of %d trained samples (%.1f%%) had a reward "
                            "fail on them (%s); every failure with its traceback is in %s",
                            tally["failed_samples"], tally["samples"], 100 * tally["share"],
                            per, self.run_dir / ERRORS_FILE)
        if tally["exceeded"]:
            raise RewardFailedError(
                f"{100 * tally['share']:.1f}% of the trained samples ({tally['failed_samples']}"
                f" of {tally['samples']}) had a reward fail on them, more than "
                f"task.reward_limits.max_failure_share={self.max_failure_share:g}; the run "
                f"finished and checkpointed, but its rewards are not to be trusted. See "
                f"{self.run_dir / ERRORS_FILE} (tally: {self.run_dir / TALLY_FILE}); fix the "
                "reward, or raise max_failure_share (1: never fail the run).")
