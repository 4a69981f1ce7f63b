"""Weight-sync time from a train engine into a rollout engine, split plan/pack/wire/load.

For each model size a random Llama is written from a config, a train engine
(`--trainer`, default `fsdp`) and a rollout engine (`--backend`, default `vllm`) load it
in this process (colocated, one rank), and the run's `WeightSyncService` (built once:
`first_plan_s`) moves every parameter `--runs` times. Reported per size (medians over
runs):

* `plan_s`: planning inside a sync (0: the service plans once, when it is built);
* `pack_s` / `wire_s` / `load_s`: the executor's split — copying regions out of the
  trainer's shards into bucket buffers, the transport, and `load_weights` into the
  rollout engine (for vLLM this includes the adapter's own hop into vLLM's worker);
* `engine_*`: the rollout adapter's own split of its `load_weights` time, when it
  reports one (`last_sync`): packing for its side channel, the rpc, and the copy into
  the engine's parameters plus its post-load processing (vLLM: repacking its CPU
  kernels from the new weights).

With `--lora-rank R` each size is synced a second time with LoRA adapters of rank R
(`trainer.lora`, all-linear): its figures sit under the size's `lora` key with
`bytes_vs_full` and `total_s_vs_full`, measured in the same run as the full sync.

After each sync the rollout engine generates once on the loaded weights (unless
`--no-generate`): `generate_tokens_per_s` is reported beside the load time, never mixed
with it. Prompts and answer cap follow `--shape` (quickstart: 16 prompts of 32 tokens, up
to 64 tokens; realistic: 8 prompts of 128 tokens, long-tailed answers up to 512).

With `--split` the trainer and the rollout engine run in two processes started by
`torchrun` (one machine, or two hosts), and the run compares `weight_sync.encoding: full`
and `delta` side by side after real optimiser steps (bytes on the wire, the time split,
the busiest sender's share and the share of changed bf16 values):
`peerflow.bench.weight_sync_split`.

Sizes (every model from the one bench builder, `peerflow.bench.shapes.build_model`):
`quickstart` (the quickstart's hidden 128, 2 layers), `realistic` (the ~50 M-parameter
bench model: hidden 768, 8 layers) and `500m` (hidden 1536, 16 layers, MLP 6144: ~553 M
parameters, ~2.2 GB in float32 per copy). `--shape realistic` defaults `--sizes` to
`realistic`, `--shape quickstart` to `quickstart,500m`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from peerflow.bench.options import add_runs_argument
from peerflow.bench.shapes import (
    BENCH_MODEL,
    GENERATION,
    MODEL_OPTIONS,
    add_shape_argument,
    build_model,
    pick,
    prompt_ids,
)

#: Model shapes by size name: (hidden, intermediate, layers, heads, kv heads).
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "quickstart": (128, 512, 2, 4, 2),
    "realistic": tuple(BENCH_MODEL[key] for key in MODEL_OPTIONS),  # type: ignore[dict-item]
    "500m": (1536, 6144, 16, 12, 4),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    parser.add_argument("--backend", "--rollout", dest="backend", default=None,
                        help="rollout engine (default vllm; hf with --split)")
    parser.add_argument("--trainer", default="fsdp", help="train engine (default fsdp)")
    add_shape_argument(parser)
    parser.add_argument("--sizes", help=f"comma-separated model sizes from {sorted(SIZES)} "
                        "(quickstart shape: quickstart,500m; realistic: realistic)")
    parser.add_argument("--no-generate", dest="generate", action="store_false",
                        help="skip the generate call after each sync")
    add_runs_argument(parser, 3, "timed syncs per size")
    parser.add_argument("--bucket-mb", type=int, default=256, help="bucket size in MiB")
    parser.add_argument("--transport", default=None,
                        help="registered weight transport (default: auto)")
    parser.add_argument("--rollout-option", action="append", default=[], metavar="KEY=VALUE",
                        help="rollout adapter option, e.g. executor=multiprocess (YAML value)")
    parser.add_argument("--split", action="store_true",
                        help="trainer and rollout in two torchrun processes (or hosts): full "
                        "vs delta encoding side by side after real optimiser steps "
                        "(peerflow.bench.weight_sync_split)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="--split: both engines' dtype (default bfloat16)")
    parser.add_argument("--rollout-dtype", default=None,
                        help="--split: the rollout's dtype (default: --dtype); bfloat16 "
                        "with --dtype float32 is float32 trainer weights, a bfloat16 rollout")
    parser.add_argument("--lr", type=float, default=1e-6,
                        help="--split: the trainer's learning rate (default 1e-6)")
    parser.add_argument("--init-range", type=float, default=None,
                        help="--split: initializer_range of the built model (default the "
                        "bench model's 0.002; a pretrained model's weights are ~0.02)")
    parser.add_argument("--prompts", type=int, help="--split: prompts per train step")
    parser.add_argument("--group-size", type=int, default=8,
                        help="--split: answers per prompt in the train step (default 8)")
    parser.add_argument("--prompt-tokens", type=int,
                        help="--split: tokens per prompt in the train step (shape's)")
    parser.add_argument("--max-tokens", type=int,
                        help="--split: answer cap in the train step (shape's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, metavar="R",
                        help="also sync LoRA adapters of rank R (all-linear, alpha 2R) on the "
                        "same model and report them next to the full sync (default 0: off)")


def _options(cls: Any, pairs: list[str]) -> Any:
    import yaml

    from peerflow.config.structure import structure

    values = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        values[key] = yaml.safe_load(value)
    return structure(cls.options_class, values, f"rollout.{cls.name}")


def _measure(size: str, args: argparse.Namespace, workdir: Path, lora: Any = None
             ) -> dict[str, Any]:
    import torch

    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.layout import ParallelLayout
    from peerflow.plugins import get_plugin_manager
    from peerflow.reshard import WeightSyncService

    hidden, inter, layers, heads, kv = SIZES[size]
    model = build_model(workdir / size, dict(zip(MODEL_OPTIONS, SIZES[size], strict=True)))
    requests, sampling = _generation(model, args.shape)
    pm = get_plugin_manager()
    train_cls = pm.registry("train_engine").get(args.trainer)
    rollout_cls = pm.registry("rollout_engine").get(args.backend or "vllm")
    train_cls.ensure_installed()
    rollout_cls.ensure_installed()
    context = EngineContext(model_path=model, layout=ParallelLayout(), lora=lora)
    trainer = train_cls(context, train_cls.options_class(), OptimSettings())
    rollout = rollout_cls(context, _options(rollout_cls, args.rollout_option))
    try:
        start = time.perf_counter()
        service = WeightSyncService.build(trainer, rollout, transport=args.transport or "auto",
                                          bucket_bytes=args.bucket_mb * 2**20)
        first_plan_s = time.perf_counter() - start
        runs = []
        for version in range(1, args.runs + 1):
            stats = service.sync(version)
            run = {"plan_s": stats.plan_s, "pack_s": stats.pack_s, "wire_s": stats.wire_s,
                   "load_s": stats.load_s, "bytes": stats.bytes, "buckets": stats.buckets,
                   "peak_extra_bytes": getattr(stats, "peak_extra_bytes", 0)}
            run["total_s"] = run["plan_s"] + run["pack_s"] + run["wire_s"] + run["load_s"]
            if args.generate:
                run.update(_timed_generate(rollout, requests, sampling))
            engine_stats = getattr(rollout, "last_sync", None)
            if engine_stats is not None:
                run.update(engine_pack_s=engine_stats.pack_s, engine_wire_s=engine_stats.wire_s,
                           engine_load_s=engine_stats.load_s)
            runs.append(run)
        params = _parameters(service.plan)
    finally:
        rollout.shutdown()
        trainer.shutdown()
        del trainer, rollout
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    medians = {key: statistics.median(r[key] for r in runs)
               for key in runs[0] if key.endswith(("_s", "_per_s"))}
    return {"parameters": params, "model": {"hidden": hidden, "intermediate": inter,
                                            "layers": layers, "heads": heads, "kv_heads": kv},
            "first_plan_s": first_plan_s, **medians,
            "bytes": runs[0]["bytes"], "buckets": runs[0]["buckets"],
            # One process hosts both engines here, so rank 0 sends every byte.
            "bytes_sent_per_rank": {"0": runs[0]["bytes"]},
            "median_of": args.runs, "runs": runs}


def _lora_next_to_full(full: dict[str, Any], size: str, args: argparse.Namespace,
                       workdir: Path) -> dict[str, Any]:
    """The same model's sync with LoRA adapters of `--lora-rank` (adapters only move)."""
    from peerflow.engines.lora import LoraConfig

    lora = _measure(size, args, workdir, LoraConfig(rank=args.lora_rank,
                                                    alpha=2.0 * args.lora_rank))
    lora.pop("runs")
    lora["bytes_vs_full"] = lora["bytes"] / full["bytes"]
    lora["total_s_vs_full"] = lora["total_s"] / full["total_s"] if full["total_s"] else None
    return lora


def _generation(model: str, shape: str) -> tuple[list, Any]:
    """The shape's prompts and sampling settings for the post-sync generate call."""
    from peerflow.engines import GenerationRequest, SamplingParams

    count, length, cap = GENERATION[shape]
    requests = [GenerationRequest(request_id=i, prompt_ids=ids)
                for i, ids in enumerate(prompt_ids(model, count, length, seed=0))]
    return requests, SamplingParams(n=1, temperature=1.0, max_tokens=cap, seed=0)


def _timed_generate(rollout: Any, requests: list, sampling: Any) -> dict[str, Any]:
    start = time.perf_counter()
    results = rollout.generate(requests, sampling)
    seconds = time.perf_counter() - start
    lengths = [len(r.token_ids) for r in results]
    return {"generate_s": seconds, "generate_tokens": sum(lengths),
            "generate_tokens_per_s": sum(lengths) / seconds}


def _parameters(plan: Any) -> int:
    """HF parameters the plan fills (each counted once)."""
    seen: dict[str, int] = {}
    for specs in plan.sources.values():
        for spec in specs:
            for piece in spec.pieces:
                count = 1
                for size in piece.global_shape:
                    count *= size
                seen[piece.name] = count
    return sum(seen.values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measures every requested size and returns the JSON result."""
    if args.split:
        from peerflow.bench.weight_sync_split import run_split

        return run_split(args, SIZES)
    sizes_arg = pick(args.sizes, args.shape, "quickstart,500m", "realistic")
    sizes = [s.strip() for s in sizes_arg.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"peerflow bench weight-sync: unknown --sizes {unknown}; "
                         f"choose from {sorted(SIZES)}.")
    results = {}
    with tempfile.TemporaryDirectory(prefix="peerflow-bench-sync-") as tmp:
        for size in sizes:
            results[size] = _measure(size, args, Path(tmp))
            if args.lora_rank:
                results[size]["lora"] = _lora_next_to_full(results[size], size, args, Path(tmp))
    return {"benchmark": "weight-sync", "shape": args.shape, "backend": args.backend or "vllm",
            "trainer": args.trainer, "lora_rank": args.lora_rank,
            "bucket_mb": args.bucket_mb, "median_of": args.runs, "sizes": results,
            "runs": {size: r["runs"] for size, r in results.items()}}
