"""Asynchronous streaming mode: bounded staleness, p2p sample streaming, async weight push.

The pieces are small and independently testable; `peerflow.worker.async_schedule` wires
them into the rollout and trainer schedules the run driver runs in `runtime.mode: async`.
"""

from peerflow.streaming.staleness import StalenessError, StalenessScheduler, StepAssignment

__all__ = ["StalenessError", "StalenessScheduler", "StepAssignment"]
