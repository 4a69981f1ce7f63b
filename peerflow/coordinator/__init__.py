"""The data coordinator: peer-to-peer redistribution of batches between layouts.

Interface for the worker (`peerflow.worker`): for each `RouteOp` in its program, every
rank of the route (`route.src ∪ route.dst`) calls

    batch = redistribute(batch, op.route, route_groups.get(op.route),
                         mode=config.runtime.coordinator,
                         transport=config.runtime.coordinator_transport)

with `route_groups = RouteGroups.build(plan)` (one process group per route's rank set)
created once at start-up on every rank. Bytes move over gloo or, between processes of one
host, shared memory (`coordinator.transport`). Pure
planning pieces (`balance_groups`, `plan_transfer`) are shared with the planner's scaled
simulation.
"""

from peerflow.coordinator.assign import balance_groups, balance_groups_local
from peerflow.coordinator.groups import RouteGroups
from peerflow.coordinator.redistribute import LOAD_FIELDS, TransferStats, redistribute
from peerflow.coordinator.transfer import TransferPlan, dp_members, plan_transfer
from peerflow.coordinator.wire import pack_batch, unpack_batch

__all__ = [
    "LOAD_FIELDS",
    "RouteGroups",
    "TransferPlan",
    "TransferStats",
    "balance_groups",
    "balance_groups_local",
    "dp_members",
    "pack_batch",
    "plan_transfer",
    "redistribute",
    "unpack_batch",
]
