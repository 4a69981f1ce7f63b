"""The planner: roles on ranks, routes between layouts, one program per rank.

Interface for the worker (`peerflow.worker`): every rank computes

    plan = plan_run(config, world_size, pm)
    for op in plan.program(rank):      # each step
        RunNode  -> run op.node (kind op.kind) with the engines of op.role
        RouteOp  -> batch = redistribute(batch, op.route, groups.get(op.route), …)

`peerflow plan CONFIG --nprocs N` prints the same plan; `simulate_route` models the
bytes a route moves at any scale from the same planning code.
"""

from peerflow.planner.placement import place_roles
from peerflow.planner.plan import Op, Route, RouteOp, RunNode, RunPlan, plan_run
from peerflow.planner.simulate import RouteTraffic, simulate_route

__all__ = [
    "Op",
    "Route",
    "RouteOp",
    "RouteTraffic",
    "RunNode",
    "RunPlan",
    "place_roles",
    "plan_run",
    "simulate_route",
]
