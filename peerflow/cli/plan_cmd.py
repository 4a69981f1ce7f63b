"""`peerflow plan CONFIG [--nprocs N] [--format text|json|dot] [--rank R] [--simulate]`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from peerflow.cli.options import add_config_arguments

HELP = "show the per-rank programs and data routes of a run"
DESCRIPTION = ("Plan a run without starting anything: role layouts, the redistribution route "
               "of every edge whose layouts differ, and each rank's program. Programs that are "
               "the same on many ranks are shown once with their rank ranges.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds CONFIG, `--set`, `--nprocs`, `--format`, `--rank` and `--simulate`."""
    add_config_arguments(parser)
    parser.add_argument("--nprocs", type=int, default=None,
                        help="world size to plan for (default: runtime.nprocs)")
    parser.add_argument("--format", choices=["text", "json", "dot"], default="text",
                        help="output format (dot: Graphviz source of the graph)")
    parser.add_argument("--rank", type=int, default=None,
                        help="print only this rank's program, one op a line")
    parser.add_argument("--simulate", action="store_true",
                        help="add the modelled bytes of each route through the busiest rank, "
                        "peer-to-peer and centralized, for one step's batch")


def _simulation(plan: Any, config: Any) -> list[dict[str, Any]]:
    from peerflow.planner import simulate_route

    rows = []
    for route in plan.routes:
        per_dp = max(1, plan.samples_per_step // route.src.dp)
        for mode in ("p2p", "centralized"):
            t = simulate_route(route.src, route.dst, samples_per_dp=per_dp,
                               group_size=config.rollout.sampling.n,
                               mean_tokens=config.rollout.sampling.max_tokens, mode=mode,
                               seed=config.seed)
            rows.append({"route": route.name, "mode": mode, "samples": t.samples,
                         "busiest_rank_bytes": t.busiest_rank_bytes,
                         "busiest_rank": t.busiest_rank})
    return rows


def run(args: argparse.Namespace) -> int:
    """Prints the plan; raises `ConfigError` (exit 1) when the run cannot be planned.

    The config is checked as `peerflow config validate` checks it (names, option keys,
    layouts against the model's heads and layers), without loading the model or
    opening the dataset.
    """
    from peerflow.config import load_config, validate_config
    from peerflow.errors import ConfigError
    from peerflow.planner import plan_run
    from peerflow.plugins import get_plugin_manager
    from peerflow.workflow.on_policy import old_logprob_decision

    nprocs = [f"runtime.nprocs={args.nprocs}"] if args.nprocs else []
    config = load_config(args.config, [*args.overrides, *nprocs])
    pm = get_plugin_manager()
    validate_config(config, pm)
    plan = plan_run(config, config.runtime.nprocs, pm)
    if args.rank is not None:
        try:
            program = plan.program(args.rank)
        except ValueError as exc:
            raise ConfigError(f"--rank {args.rank}: {exc}") from None
        for op in program:
            print(op.describe())
        return 0
    simulation = _simulation(plan, config) if args.simulate else None
    decision = old_logprob_decision(config, plan.graph)
    if args.format == "json":
        data = plan.to_dict()
        data["old_logprob"] = decision.to_dict()
        if simulation is not None:
            data["simulation"] = simulation
        print(json.dumps(data, indent=1))
    elif args.format == "dot":
        print(plan.to_dot())
    else:
        print(plan.to_text())
        print(f"\n{decision.describe()}")
        if simulation is not None:
            print("\nmodelled traffic per step (busiest rank):")
            for row in simulation:
                print(f"  {row['route']:32s} {row['mode']:12s} {row['busiest_rank_bytes']:>14,d} "
                      f"bytes (rank {row['busiest_rank']}, {row['samples']} samples)")
    return 0
