"""Data coordinator: peer-to-peer vs centralized routing of one step's batch.

For each process count N, N gloo processes on this machine each build the same
synthetic step batch (prompt and response ids, log-probs, advantages, rewards, the
per-sample examples) and hold their dp-shard of it as producers `dpN`; the batch is
redistributed to consumers `dp(N/2)×tp2` (the colocated rollout → trainer route of a
tp=2 trainer), peer to peer and centralized (gather to one rank, scatter), over each
transport of `--transport` (`auto`: shared memory on this host; `gloo`), in alternation:
one repetition of every (transport, mode) after the other.
Every run checks that each sample reached exactly one consumer dp-rank. Reported per
(N, transport, mode): the bytes through the busiest rank (sent + received + metadata) and
the wall time of the slowest rank, and the busiest rank's thread CPU time in the call
(`TransferStats.cpu_s`: what the wall would be with a core per process; `cpu_ratio` is
p2p / centralized of it, beside the headline wall ratio; `total_cpu_s`: summed over
ranks, what sets the wall when processes outnumber cores), medians over `--runs`
repetitions after one warm-up;
and the payload bandwidth of the busiest rank next to a plain send of the same number of
bytes between two of the same processes, measured in the same run (the wire's speed):
gloo `send`, and the shared-memory channel (write, wake, read out).

`simulation` models the same route up to N = 1024 with the planner's
`simulate_route` (the runtime's planning code, no processes).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from peerflow.bench.options import add_runs_argument

#: What each timed call records (the slowest rank's wall, the busiest rank's bytes and
#: CPU, the ranks' summed CPU); reported as medians over the runs.
_MEASURED = ("wall_s", "busiest_rank_bytes", "busiest_rank_cpu_s", "total_cpu_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    parser.add_argument("--nprocs", default="2,4,8",
                        help="comma-separated process counts (even numbers; default 2,4,8)")
    parser.add_argument("--groups", type=int, default=64, help="prompts in the step batch")
    parser.add_argument("--group-size", type=int, default=8, help="answers per prompt")
    parser.add_argument("--mean-tokens", type=int, default=256,
                        help="mean response length (exponentially distributed)")
    add_runs_argument(parser, 3, "timed repetitions per mode")
    parser.add_argument("--simulate", default="8,64,256,1024",
                        help="process counts for the modelled traffic ('' to skip)")
    parser.add_argument("--sim-samples-per-rank", type=int, default=64,
                        help="samples per producer rank in the simulation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")
    parser.add_argument("--transport", default="auto,gloo",
                        help="comma-separated coordinator transports (auto|gloo|shm; the "
                             "first one's ratios are the headline; default auto,gloo)")


def make_step_batch(groups: int, group_size: int, mean_tokens: int, seed: int) -> Any:
    """The synthetic global step batch (identical on every rank for a seed)."""
    import torch

    from peerflow.batch import Batch, RaggedField

    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    prompt_len = torch.randint(8, 64, (groups,), generator=gen).repeat_interleave(group_size)
    resp_len = (torch.empty(n).exponential_(1 / mean_tokens, generator=gen).long() + 1)
    batch = Batch(sample_id=torch.arange(n),
                  group_id=torch.arange(groups).repeat_interleave(group_size),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    total_p, total_r = int(prompt_len.sum()), int(resp_len.sum())
    offsets_p = torch.cat([torch.zeros(1, dtype=torch.int64), prompt_len.cumsum(0)])
    offsets_r = torch.cat([torch.zeros(1, dtype=torch.int64), resp_len.cumsum(0)])
    batch.set("prompt_ids", RaggedField(values=torch.randint(0, 32000, (total_p,), generator=gen),
                                        offsets=offsets_p))
    batch.set("response_ids", RaggedField(
        values=torch.randint(0, 32000, (total_r,), generator=gen), offsets=offsets_r))
    for name in ("rollout_logprobs", "old_logprobs", "advantages"):
        batch.set(name, RaggedField(values=torch.randn(total_r, generator=gen),
                                    offsets=offsets_r))
    batch.set("reward", torch.randn(n, generator=gen))
    batch.set_objects("example", [{"index": int(g)} for g in batch.group_id])
    return batch


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from peerflow.coordinator import TransferStats, dp_members, redistribute
    from peerflow.layout import ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    src = ParallelLayout(dp=world)
    dst = ParallelLayout(dp=max(1, world // 2), tp=2 if world >= 2 else 1)
    full = make_step_batch(args["groups"], args["group_size"], args["mean_tokens"], args["seed"])
    mine = [i for i, g in enumerate(full.group_id.tolist()) if g % world == rank]
    shard = full.select(mine)
    combos = [(t, m) for t in args["transports"] for m in ("p2p", "centralized")]
    records: list[dict[str, Any]] = []  # one per timed (run, transport, mode)
    used: dict[str, str] = {}
    for run in range(args["runs"] + 1):
        for transport, mode in combos:  # alternating, so a change of load hits all alike
            stats = TransferStats()
            dist.barrier()
            got = redistribute(shard, (src, dst), None, mode=mode, transport=transport,
                               stats=stats, timeout=300)
            used[transport] = stats.transport
            mine_stats = torch.tensor([stats.wall_s, float(stats.bytes_total), stats.cpu_s],
                                      dtype=torch.float64)
            gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(gathered, mine_stats)
            ids = torch.zeros(1, dtype=torch.int64)
            if dst.coord(rank).tp == 0:
                ids += len(got)
            dist.all_reduce(ids)
            if int(ids) != len(full):
                raise RuntimeError(f"{mode}/{transport}: {int(ids)} samples arrived, "
                                   f"expected {len(full)}")
            if run:  # the first run warms up connections
                walls, sizes, cpus = torch.stack(gathered).T.tolist()
                records.append({"transport": transport, "mode": mode, "wall_s": max(walls),
                                "busiest_rank_bytes": max(sizes),
                                "busiest_rank_cpu_s": max(cpus), "total_cpu_s": sum(cpus)})
    results = {}
    for transport, mode in combos:
        timed = [r for r in records if (r["transport"], r["mode"]) == (transport, mode)]
        row = {key: statistics.median(r[key] for r in timed) for key in _MEASURED}
        row["busiest_rank_bytes"] = int(row["busiest_rank_bytes"])
        results[f"{used[transport]}/{mode}"] = row
    nbytes = results[f"{used[combos[0][0]]}/p2p"]["busiest_rank_bytes"]
    plain = {"gloo_send": _plain_send(nbytes, args["runs"], "gloo"),
             "shm_send": _plain_send(nbytes, args["runs"], "shm")}
    if rank == 0:
        members = dp_members(dst)
        out.put({"samples": len(full), "route": f"{src.describe()} -> {dst.describe()}",
                 "consumer_dp_groups": [list(m) for m in members], "modes": results,
                 "transports": used, "plain": plain})
    dist.destroy_process_group()


def _plain_send(nbytes: int, runs: int, transport: str) -> dict[str, Any]:
    """Times a plain send of `nbytes` from rank 0 to rank 1 (median of `runs`).

    `gloo`: one `dist.send`; `shm`: the coordinator's shared-memory channel (write into
    a segment, wake the receiver, which reads its message out into memory of its own).
    """
    import time

    import torch
    import torch.distributed as dist

    from peerflow.coordinator.transport import open_channel

    rank = dist.get_rank()
    buf = torch.ones(max(1, nbytes), dtype=torch.uint8)
    walls = []
    for run in range(runs + 1):
        dist.barrier()
        start = time.perf_counter()
        if transport == "gloo" and rank in (0, 1):
            (dist.send(buf, dst=1) if rank == 0 else dist.recv(buf, src=0))
        elif rank in (0, 1):
            channel = open_channel((0, 1), "shm", timeout=300)
            outgoing = [(1, buf, buf.numel())] if rank == 0 else []
            channel.exchange(outgoing, {0: buf.numel()} if rank == 1 else {}, tag=9,
                             what="shm send", timeout=300)
        wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        if run:
            walls.append(float(wall))
    return {"bytes": int(buf.numel()), "wall_s": statistics.median(walls)}


def _measure(world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Runs the benchmark's `world` processes; returns rank 0's report.

    They fork from the warm fork server, as `peerflow train` starts its workers
    (`peerflow.launch.warm`): a spawned process would import torch again.
    """
    from peerflow.distributed.init import free_port
    from peerflow.launch.warm import warm_context, warm_process

    out = warm_context().Queue()
    port = free_port()
    procs = [warm_process(_worker, (r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    failed = [p.exitcode for p in procs if p.exitcode]
    if failed:
        raise RuntimeError(f"bench coordinator: {len(failed)} worker(s) failed at N={world}")
    return result


def _simulation(counts: list[int], per_rank: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    from peerflow.layout import ParallelLayout
    from peerflow.planner import simulate_route

    rows = []
    for n in counts:
        src, dst = ParallelLayout(dp=n), ParallelLayout(dp=max(1, n // 2), tp=2)
        for mode in ("p2p", "centralized"):
            t = simulate_route(src, dst, samples_per_dp=per_rank, group_size=args["group_size"],
                               mean_tokens=args["mean_tokens"], mode=mode, seed=args["seed"])
            rows.append({"nprocs": n, "mode": mode, "busiest_rank_bytes": t.busiest_rank_bytes,
                         "samples": t.samples})
    return rows


def _gbps(row: dict[str, Any]) -> float:
    return row["busiest_rank_bytes"] / max(1e-9, row["wall_s"]) / 1e9


def _ratios(modes: dict[str, Any], transport: str, plain: dict[str, Any]) -> dict[str, Any]:
    p2p, central = modes[f"{transport}/p2p"], modes[f"{transport}/centralized"]
    return {
        "busiest_bytes_centralized_over_p2p": round(
            central["busiest_rank_bytes"] / max(1, p2p["busiest_rank_bytes"]), 3),
        "wall_p2p_over_centralized": round(p2p["wall_s"] / max(1e-9, central["wall_s"]), 3),
        "cpu_ratio": round(p2p["busiest_rank_cpu_s"]
                           / max(1e-9, central["busiest_rank_cpu_s"]), 3),
        **{f"p2p_gbps_over_{name}": round(_gbps(p2p) / max(1e-9, _gbps(row)), 3)
           for name, row in plain.items()},
    }


def _wire_cost(params: dict[str, Any], calls: int = 200) -> dict[str, Any]:
    """`pack_batch` and `unpack_batch` of the step batch in this process: median µs per call.

    The header (`peerflow.wirecodec` msgpack, checked on unpack) is the part that is not
    a byte copy; `header_bytes` is its size.
    """
    import time

    import torch

    from peerflow.coordinator.wire import pack_batch, unpack_batch

    batch = make_step_batch(params["groups"], params["group_size"], params["mean_tokens"],
                            params["seed"])
    packed = pack_batch(batch)
    times: dict[str, list[float]] = {"pack_us": [], "unpack_us": []}
    for _ in range(calls):
        for key, call in (("pack_us", lambda: pack_batch(batch)),
                          ("unpack_us", lambda: unpack_batch(packed))):
            start = time.perf_counter()
            call()
            times[key].append((time.perf_counter() - start) * 1e6)
    return {"header_bytes": int(packed[8:16].clone().view(torch.int64)[0]),
            **{key: round(statistics.median(v), 1) for key, v in times.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark; returns the JSON document."""
    from peerflow.coordinator.transport import check_transport

    counts = [int(x) for x in str(args.nprocs).split(",") if x.strip()]
    bad = [n for n in counts if n < 2 or n % 2]
    if bad:
        raise SystemExit(f"--nprocs {args.nprocs}: use even counts of at least 2 (got {bad}); "
                         "the consumer layout is dp(N/2)×tp2.")
    transports = [t.strip() for t in str(args.transport).split(",") if t.strip()]
    for transport in transports:
        check_transport(transport)
    params = {"groups": args.groups, "group_size": args.group_size, "transports": transports,
              "mean_tokens": args.mean_tokens, "runs": max(1, args.runs), "seed": args.seed}
    results, ratios = [], {}
    for n in counts:
        measured = _measure(n, params)
        for key, row in measured["modes"].items():
            transport, mode = key.split("/")
            results.append({"nprocs": n, "mode": mode, "transport": transport,
                            "route": measured["route"],
                            "busiest_rank_bytes": row["busiest_rank_bytes"],
                            "wall_s": round(row["wall_s"], 6), "samples": measured["samples"],
                            "busiest_rank_cpu_s": round(row["busiest_rank_cpu_s"], 6),
                            "total_cpu_s": round(row["total_cpu_s"], 6),
                            "busiest_rank_gbps": round(_gbps(row), 3)})
        plain = {name: {"busiest_rank_bytes": p["bytes"], "wall_s": p["wall_s"]}
                 for name, p in measured["plain"].items()}
        for name, row in plain.items():
            results.append({"nprocs": n, "mode": name, "bytes": row["busiest_rank_bytes"],
                            "wall_s": round(row["wall_s"], 6), "gbps": round(_gbps(row), 3)})
        used = list(dict.fromkeys(measured["transports"][t] for t in transports))
        by_transport = {t: _ratios(measured["modes"], t, plain) for t in used}
        ratios[str(n)] = {**by_transport[used[0]], "transport": used[0],
                          "by_transport": by_transport}
    sim_counts = [int(x) for x in str(args.simulate).split(",") if x.strip()]
    return {
        "benchmark": "coordinator",
        "results": results,
        "ratios": ratios,
        "runs": params["runs"],
        "median_of": params["runs"],
        "batch": {"groups": args.groups, "group_size": args.group_size,
                  "mean_tokens": args.mean_tokens, "seed": args.seed},
        "simulation": _simulation(sim_counts, args.sim_samples_per_rank, params),
        "simulation_note": "modelled bytes (planner.simulate_route), "
                           f"{args.sim_samples_per_rank} samples per producer rank",
        "wire": _wire_cost(params),
        "cpu_count": os.cpu_count(),
    }
