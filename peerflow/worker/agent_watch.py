"""`AgentWatch`: agent failures named each step, and a run whose episodes all fail stopped.

The run driver calls `check` on every rank of the schedule with each step's reduced
metrics (the same dict everywhere, so every rank decides alike):

* a step with failed episodes (`agent/env_errors` > 0) is reported on the reporting rank:
  how many of the step's samples failed and where each failure's traceback is
  (`RUN_DIR/agent_errors.jsonl`, `peerflow.agents.failure_log`);
* `agent/env_errors` equal to `samples` (every episode failed) for
  `rollout.agent.fatal_after_steps` steps in a row raises `AgentFailedError`, naming the
  first failure of that streak with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from peerflow.errors import PeerFlowError

log = logging.getLogger("peerflow.worker")


class AgentFailedError(PeerFlowError):
    """Every agent episode failed for `rollout.agent.fatal_after_steps` steps in a row."""


@attrs.define(eq=False)
class AgentWatch:
    """Follows each step's failed agent episodes (see the module docstring)."""

    run_dir: Path
    fatal_after_steps: int = 0
    """`rollout.agent.fatal_after_steps` (0: never stop; runs without agents)."""
    reports: bool = False
    """Whether this rank reports (logs each step's failures)."""
    streak: int = 0
    """Steps in a row whose every episode failed."""
    first_step: int = 0
    """The first step of the streak."""

    @classmethod
    def from_config(cls, config: Any, run_dir: Path, *, reports: bool) -> AgentWatch:
        """The watch of a run (`rollout.agent.fatal_after_steps`)."""
        agent = config.rollout.agent
        return cls(run_dir=Path(run_dir), reports=reports,
                   fatal_after_steps=agent.fatal_after_steps if agent is not None else 0)

    def check(self, step: int, reduced: Mapping[str, float]) -> None:
        """Reports a step's failed episodes; raises when all failed for too long.

        Raises:
            AgentFailedError: every episode of the last `fatal_after_steps` steps failed.
        """
        from peerflow.agents.failure_log import AGENT_ERRORS_FILE

        failed = float(reduced.get("agent/env_errors", 0.0))
        samples = float(reduced.get("samples", 0.0))
        if failed and self.reports:
            log.warning("step %d: %d of %d agent episodes failed (environment errors and "
                        "time-outs, left out as rollout.agent.on_env_error says); each "
                        "failure with its traceback is in %s", step, failed, samples,
                        self.run_dir / AGENT_ERRORS_FILE)
        everything = samples > 0 and failed >= samples
        if not everything:
            self.streak = 0
            return
        self.streak += 1
        if self.streak == 1:
            self.first_step = step
        if self.fatal_after_steps and self.streak >= self.fatal_after_steps:
            raise AgentFailedError(self._stop_message(step))

    def _stop_message(self, step: int) -> str:
        from peerflow.agents.failure_log import AGENT_ERRORS_FILE, read_agent_errors

        found = [e for e in read_agent_errors(self.run_dir) if e["step"] >= self.first_step]
        first = min(found, key=lambda e: (e["step"], e.get("sample_id", 0)), default=None)
        where = ("" if first is None else
                 f" The first (step {first['step']}, sample {first.get('sample_id')}, "
                 f"{first.get('finish_reason')} {first.get('type')}): {first['message']}\n"
                 f"{first.get('traceback') or '(no traceback)'}")
        return (f"every agent episode failed in the last {self.streak} steps (steps "
                f"{self.first_step} to {step}), so the run would learn nothing; stopping."
                f"{where}\nEvery failure is in {self.run_dir / AGENT_ERRORS_FILE}. Fix the "
                "environment or agent (run one episode by hand), or raise "
                "rollout.agent.fatal_after_steps (0: never stop).")
