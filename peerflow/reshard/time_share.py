"""Time sharing of accelerator memory between a colocated rollout engine and trainer.

verl's hybrid-engine order, which the run's `WeightSyncService` follows when the rollout
engine declares `Capabilities.sleep` and shares its devices with the trainer:

1. generate, then `sleep()` — weights and KV cache released for training;
2. at the next weight sync: `wake(tags=("weights",))`, load the new weights,
   `wake(tags=("kv_cache",))` — the KV cache is never allocated beside stale buffers;
3. generate (a step without a sync first wakes whatever still sleeps).

An engine whose `wake` takes no `tags` (written before tags existed) is woken whole,
once, before loading — the way pluggy calls a hook implementation that accepts fewer
arguments.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import attrs

from peerflow.engines import RolloutEngine

#: What a rollout engine's `wake(tags)` restores, in the order a sync needs them.
WEIGHTS, KV_CACHE = "weights", "kv_cache"


@attrs.define(eq=False)
class TimeSharing:
    """Puts a rollout engine to sleep after generating and wakes it in order."""

    rollout: RolloutEngine
    asleep: set[str] = attrs.field(factory=set)
    """What is released now (`weights`, `kv_cache`)."""

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Around generation: wakes what still sleeps, then sleeps."""
        self.wake((WEIGHTS, KV_CACHE))
        yield
        if not self.asleep:
            self.rollout.sleep()
            self.asleep = {WEIGHTS, KV_CACHE}

    def wake(self, tags: Sequence[str]) -> None:
        """Wakes the named parts that sleep (everything, for an engine without tags)."""
        wanted = [t for t in tags if t in self.asleep]
        if not wanted:
            return
        if "tags" in inspect.signature(self.rollout.wake).parameters:
            self.rollout.wake(tags=tuple(wanted))
            self.asleep -= set(wanted)
        else:
            self.rollout.wake()
            self.asleep.clear()
