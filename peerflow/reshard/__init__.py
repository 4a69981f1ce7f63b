"""Weight resharding: plan (pure, on metadata), bucket, move over a transport, load.

* `plan_reshard(sources, destinations) -> ReshardPlan` — index-box intersection with
  coverage checks (`peerflow.reshard.plan`); regions several replicas hold are shared
  among them, balancing bytes per sender (`peerflow.reshard.senders`).
* `make_buckets(plan, bucket_bytes)` and `run_plan(...)` — the executor.
* `WeightSyncService.build(trainer, rollout, ...)` — the run's one weight sync (plan,
  buckets, transport, memory meter): lockstep `sync(version)` and streaming
  `pack` / `transfer` / `apply` (`peerflow.reshard.service`); `sync_weights(...)` is a
  one-off sync for tests and the conformance suite.
* Transports: `WeightTransport`, registered through `peerflow_register_weight_transports`
  (built-ins `inprocess`, `torch`, `torch_broadcast`, `cuda_ipc` in
  `peerflow.reshard.transports`).
"""

from __future__ import annotations

from peerflow.reshard.buckets import Bucket, make_buckets
from peerflow.reshard.executor import MemoryMeter, run_plan
from peerflow.reshard.plan import ReshardPlan, Transfer, plan_reshard
from peerflow.reshard.service import (
    DEFAULT_BUCKET_BYTES,
    WeightSyncService,
    gather_specs,
    plan_weight_sync,
    sync_weights,
)
from peerflow.reshard.transport import WeightTransport, make_transport

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "MemoryMeter",
    "ReshardPlan",
    "Transfer",
    "WeightSyncService",
    "WeightTransport",
    "gather_specs",
    "make_buckets",
    "make_transport",
    "plan_reshard",
    "plan_weight_sync",
    "run_plan",
    "sync_weights",
]
