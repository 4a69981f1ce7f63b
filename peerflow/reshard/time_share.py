"""Time sharing of accelerator memory between a colocated rollout engine and trainer.

verl's hybrid-engine order, which the run's `WeightSyncService` follows when the rollout
engine declares `Capabilities.sleep` and shares its devices with the trainer:

1. generate, then `sleep()` — weights and KV cache released for training;
2. at the next weight sync: `wake(tags=("weights",))`, load the new weights,
   `wake(tags=("kv_cache",))` — the KV cache is never allocated beside stale buffers;
3. generate (a step without a sync first wakes whatever still sleeps).

`wake` has one signature, `wake(tags)`, and is always called with the tags; an engine
that cannot restore the parts separately restores everything on the first call
(`peerflow.engines.RolloutEngine.wake`).
"""

from __future__ import annotations

import contextlib
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
        """Wakes the named parts that sleep."""
        wanted = [t for t in tags if t in self.asleep]
        if not wanted:
            return
        self.rollout.wake(tuple(wanted))
        self.asleep -= set(wanted)
