"""Weight resharding: plan (pure, on metadata), bucket, move over a transport, load.

* `plan_reshard(sources, destinations) -> ReshardPlan` — index-box intersection with
  coverage checks (`peerflow.reshard.plan`).
* `make_buckets(plan, bucket_bytes)` and `run_plan(...)` — the executor.
* `sync_weights(trainer, rollout, *, version, ...)` — what the runtime calls on every
  rank; see `peerflow.reshard.sync` for the call order.
* Transports: `WeightTransport`, registered through `peerflow_register_weight_transports`
  (built-ins `inprocess`, `torch`, `torch_broadcast`, `cuda_ipc` in
  `peerflow.reshard.transports`).
"""

from __future__ import annotations

from peerflow.reshard.buckets import Bucket, make_buckets
from peerflow.reshard.executor import ExecStats, MemoryMeter, run_plan
from peerflow.reshard.plan import ReshardPlan, Transfer, plan_reshard
from peerflow.reshard.sync import (
    DEFAULT_BUCKET_BYTES,
    forget_plan,
    gather_specs,
    plan_weight_sync,
    sync_weights,
)
from peerflow.reshard.transport import WeightTransport, make_transport

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "ExecStats",
    "MemoryMeter",
    "ReshardPlan",
    "Transfer",
    "WeightTransport",
    "forget_plan",
    "gather_specs",
    "make_buckets",
    "make_transport",
    "plan_reshard",
    "plan_weight_sync",
    "run_plan",
    "sync_weights",
]
