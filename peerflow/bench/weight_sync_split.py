"""`peerflow bench weight-sync --split`: full vs delta weight sync between two processes.

Run under `torchrun` with two processes (`--nproc-per-node 2` on one machine, or
`--nnodes 2` across hosts): rank 0 trains (`--trainer`, default fsdp), rank 1 serves
(`--backend`, default hf), joined by gloo on the CPU. Both engines load the bench model
of `--sizes` (one size) in `--dtype` (default bfloat16), the rollout in `--rollout-dtype`
when given (float32 trainer weights beside a bfloat16 rollout travel as bfloat16). Two
`WeightSyncService`s are built over the same plan and transport, one with
`weight_sync.encoding: full`, one with `delta`. After a warm-up sync by both (delta's
first sync is whole), every run takes one real optimiser step on rank 0 (the GRPO-shaped
batch and PPO-clip loss of `peerflow bench train`, at `--lr`, default 1e-6), then syncs
with `full`, then with `delta`, so both move the same weights side by side. Per encoding
(medians over `--runs`):

* `wire_bytes`: bytes rank 0 handed the transport (payload, tags and headers);
* `gather_s` / `pack_s` (rank 0), `wire_s` (the slower rank), `load_s` / `pause_s`
  (rank 1: the seconds its engine could not generate), `total_s` (wall, slower rank);
* `sender_share` (the busiest sender's share of the plan's bytes: one trainer rank here);
* delta only: `changed_share` (changed bf16 values over values compared, after one
  optimiser step) and `full_sends` (routes sent whole);
* `wire_s_at_1gbit` / `wire_s_at_10gbit`: `wire_bytes` over a 1 / 10 Gbit/s link.

Delta's `wire_s` includes its diff, checksums and rebuild (they run inside the exchange).
`auto_encoding` is what `weight_sync.encoding: auto` picks for these two ranks (`delta`
when they are on different hosts).

`bit_identical` says whether the rollout engine held the same bits (an int64 checksum of
every parameter) after each delta sync as after the full sync of the same version.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

#: Figures reported per encoding (medians over runs).
FIELDS = ("wire_bytes", "gather_s", "pack_s", "wire_s", "load_s", "pause_s", "total_s")


def run_split(args: argparse.Namespace, sizes: dict[str, tuple]) -> dict[str, Any]:
    """Measures one size across two torchrun processes; rank 0 returns the result."""
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("peerflow bench weight-sync --split runs under torchrun with two "
                         "processes: torchrun --nproc-per-node 2 -m peerflow bench "
                         "weight-sync --split …")
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    names = [s.strip() for s in (args.sizes or args.shape).split(",") if s.strip()]
    if len(names) != 1 or names[0] not in sizes:
        raise SystemExit(f"--split measures one size; choose --sizes from {sorted(sizes)}.")
    from peerflow.distributed.init import init_distributed, shutdown_distributed

    init_distributed("gloo", monitor=False)  # the host: both ends pack and load on it
    try:
        if dist.get_world_size() != 2:
            raise SystemExit("--split needs exactly two processes (trainer, rollout).")
        with tempfile.TemporaryDirectory(prefix="peerflow-bench-split-") as tmp:
            rows = _measure(names[0], sizes[names[0]], args, Path(tmp), dist.get_rank())
            gathered: list[Any] = [None, None]
            dist.all_gather_object(gathered, rows)  # rank 1 may read rank 0's model until here
    finally:
        shutdown_distributed()
    if gathered[0]["rank"] != 0:
        gathered.reverse()
    if rows["rank"] != 0:
        args.json = None  # rank 0 writes the result
        return {"benchmark": "weight-sync", "split": True, "rank": rows["rank"],
                "result": "printed by rank 0"}
    return _report(names[0], args, gathered[0], gathered[1])


def _engines(model: str, args: argparse.Namespace, rank: int) -> tuple[Any, Any]:
    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.layout import ParallelLayout
    from peerflow.plugins import get_plugin_manager

    pm = get_plugin_manager()
    dtype = args.dtype if rank == 0 else args.rollout_dtype or args.dtype
    context = EngineContext(model_path=model, layout=ParallelLayout(), dtype=dtype,
                            seed=args.seed)
    if rank == 0:
        cls = pm.registry("train_engine").get(args.trainer)
        cls.ensure_installed()
        return cls(context, cls.options_class(), OptimSettings(lr=args.lr)), None
    cls = pm.registry("rollout_engine").get(args.backend or "hf")
    cls.ensure_installed()
    return None, cls(context, cls.options_class())


def _measure(size: str, shape: tuple, args: argparse.Namespace, workdir: Path,
             rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from peerflow.algorithms.losses import PPOClip
    from peerflow.bench.shapes import MODEL_OPTIONS, build_model
    from peerflow.bench.train import bench_batch
    from peerflow.reshard import WeightSyncService
    from peerflow.reshard.delta import DeltaTransport

    options = dict(zip(MODEL_OPTIONS, shape, strict=True))
    if args.init_range:
        options["initializer_range"] = args.init_range
    model = build_model(workdir / size, options) if rank == 0 else ""
    shared: list[Any] = [model]
    dist.broadcast_object_list(shared, src=0)  # one build; a second host builds its own
    if rank:
        model = shared[0] if Path(shared[0], "config.json").is_file() \
            else build_model(workdir / size, options)
    parameters = _count(model)
    trainer, rollout = _engines(model, args, rank)
    services = {encoding: WeightSyncService.build(
        trainer, rollout, transport=args.transport or "torch", encoding=encoding,
        bucket_bytes=args.bucket_mb * 2**20) for encoding in ("full", "delta")}
    auto = WeightSyncService.build(trainer, rollout, transport=args.transport or "torch",
                                   plan=services["full"].plan)  # what `auto` picks here
    auto_encoding = "delta" if isinstance(auto.transport, DeltaTransport) else "full"
    batch = bench_batch(model, _batch_args(args))[0] if trainer is not None else None
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "delta": []}
    identical, step_s = [], []
    for k in range(args.runs + 1):
        if trainer is not None and k:
            start = time.perf_counter()
            trainer.train_step(batch, PPOClip())
            step_s.append(time.perf_counter() - start)
        digests = {}
        for encoding, service in services.items():
            dist.barrier()
            start = time.perf_counter()
            stats = service.sync(k + 1)
            row = {field: float(getattr(stats, field, 0.0)) for field in FIELDS}
            row.update(total_s=time.perf_counter() - start,
                       sender_share=stats.sender_share, changed=stats.changed_elements,
                       compared=stats.compared_elements, full_sends=stats.full_sends)
            if k:
                runs[encoding].append(row)
            digests[encoding] = _digest(rollout)
        if rollout is not None:
            identical.append(digests["full"] == digests["delta"])
    held = getattr(services["delta"].transport, "held_bytes", 0)
    for engine in (trainer, rollout):
        if engine is not None:
            engine.shutdown()
    return {"rank": rank, "runs": runs, "bit_identical": identical, "step_s": step_s,
            "delta_held_bytes": held, "parameters": parameters,
            "auto_encoding": auto_encoding}


def _batch_args(args: argparse.Namespace) -> argparse.Namespace:
    """The options `peerflow bench train`'s batch builder reads (shape defaults)."""
    return argparse.Namespace(shape=args.shape, prompts=args.prompts,
                              prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                              group_size=args.group_size, seed=args.seed)


def _digest(rollout: Any) -> tuple | None:
    """Two int64 checksums of every parameter of the rollout engine's model (rank 1)."""
    if rollout is None or getattr(rollout, "model", None) is None:
        return None
    import torch

    from peerflow.reshard.delta_codec import region_checksum

    return tuple(tuple(int(v) for v in region_checksum(
        p.detach().contiguous().view(-1).view(torch.uint8)))
        for p in rollout.model.state_dict().values())


def _count(model: str) -> int:
    from peerflow.bench.train import parameter_count

    return parameter_count(model)


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _report(size: str, args: argparse.Namespace, trainer: dict[str, Any],
            rollout: dict[str, Any]) -> dict[str, Any]:
    """Per encoding: rank 0's send figures, rank 1's load and pause, the slower wire."""
    out: dict[str, Any] = {}
    for encoding in ("full", "delta"):
        sent, got = trainer["runs"][encoding], rollout["runs"][encoding]
        row = {"wire_bytes": int(_median(sent, "wire_bytes")),
               "gather_s": _median(sent, "gather_s"), "pack_s": _median(sent, "pack_s"),
               "wire_s": statistics.median(max(a["wire_s"], b["wire_s"])
                                           for a, b in zip(sent, got)),
               "load_s": _median(got, "load_s"), "pause_s": _median(got, "pause_s"),
               "total_s": statistics.median(max(a["total_s"], b["total_s"])
                                            for a, b in zip(sent, got)),
               "sender_share": sent[0]["sender_share"]}
        row["wire_s_at_1gbit"] = row["wire_bytes"] * 8 / 1e9
        row["wire_s_at_10gbit"] = row["wire_bytes"] * 8 / 1e10
        if encoding == "delta":
            row["changed_share"] = statistics.median(
                r["changed"] / r["compared"] if r["compared"] else 1.0 for r in sent)
            row["full_sends"] = [r["full_sends"] for r in sent]
            row["held_bytes"] = {"trainer": trainer["delta_held_bytes"],
                                 "rollout": rollout["delta_held_bytes"]}
        row["runs"] = [{k: r[k] for k in ("wire_bytes", "wire_s", "total_s")} for r in sent]
        out[encoding] = row
    full, delta = out["full"], out["delta"]
    return {"benchmark": "weight-sync", "split": True, "size": size,
            "train_batch": {"prompts": args.prompts, "group_size": args.group_size,
                            "prompt_tokens": args.prompt_tokens,
                            "max_tokens": args.max_tokens},
            "parameters": trainer["parameters"], "dtype": args.dtype,
            "rollout_dtype": args.rollout_dtype or args.dtype, "lr": args.lr,
            "trainer": args.trainer, "backend": args.backend or "hf",
            "transport": args.transport or "torch", "bucket_mb": args.bucket_mb,
            "init_range": args.init_range, "median_of": args.runs,
            "train_step_s": statistics.median(trainer["step_s"]),
            "auto_encoding": trainer["auto_encoding"], "encodings": out,
            "bytes_full_over_delta": full["wire_bytes"] / max(delta["wire_bytes"], 1),
            "total_s_full_over_delta": full["total_s"] / max(delta["total_s"], 1e-9),
            "bit_identical": all(rollout["bit_identical"]),
            "bit_identical_runs": len(rollout["bit_identical"])}
