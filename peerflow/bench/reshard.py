"""Reshard ≥1 GB of weights Megatron tp2 → vLLM tp4 vs a plain memcpy of the same bytes.

The model is a Llama-shaped decoder (GQA, untied head) whose parameters total about
`--target-gb` of float32. Sources are the two Megatron-core tp shards (interleaved
`linear_qkv`, fused `linear_fc1`, padded vocab); destinations are the four vLLM tp shards
(`qkv_proj` as `[q; k; v]`, `gate_up_proj`, padded vocab). All ranks live in this one
process (the colocated case), so the figure isolates the planner + executor from the
network. Each run times, side by side:

* `memcpy`: one `copy_` of a flat buffer holding exactly the bytes the plan moves;
* `reshard`: `WeightSyncService.sync` into destination tensors offered through
  `weight_buffers` (zero-copy, how an in-place engine receives weights);
* `staged`: the same sync into an engine without `weight_buffers` (a bucket is staged,
  then copied into the engine by `load_weights`).

Throughput counts the plan's bytes (padding excluded) over wall time; figures are
medians over `--runs` after one untimed warm-up run. `peak_extra_bytes` is the most the
executor itself held at once (its allocation meter), compared with `2 * bucket_bytes +
largest piece`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from typing import TYPE_CHECKING, Any

from peerflow.bench.options import add_runs_argument

if TYPE_CHECKING:  # torch and the planner load in `run`: `peerflow --help` stays fast
    import torch

    from peerflow.shard import ShardSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    parser.add_argument("--target-gb", type=float, default=1.05,
                        help="approximate parameter size in GB (float32); default 1.05")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--bucket-mb", type=float, default=256.0,
                        help="bucket size in MiB (default 256)")
    add_runs_argument(parser, 3, "repetitions (median reported)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (default 1)")


def model_config(target_gb: float, hidden: int, vocab: int) -> dict[str, Any]:
    """A Llama-shaped config with about `target_gb` GB of float32 parameters."""
    heads, kv, inter = hidden // 64, max(1, hidden // 256), int(hidden * 2.75) // 64 * 64
    per_layer = 2 * hidden * heads * 64 + 2 * hidden * kv * 64 + 3 * hidden * inter + 2 * hidden
    embed = 2 * vocab * hidden
    layers = max(2, math.ceil((target_gb * 1e9 / 4 - embed) / per_layer))
    layers += layers % 2
    return dict(model_type="llama", vocab_size=vocab, hidden_size=hidden,
                intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=64, tie_word_embeddings=False)


class _Sources:
    """Megatron tp shards held in memory (the trainer side of the sync)."""

    def __init__(self, specs: list[ShardSpec]) -> None:
        import torch

        self.specs = specs
        generator = torch.Generator().manual_seed(0)
        self.tensors = {s.local_name: torch.rand(s.local_shape, generator=generator)
                        for s in specs}

    def weight_sources(self) -> list[ShardSpec]:
        return self.specs

    def materialize(self, specs: list[ShardSpec]) -> Any:
        return contextlib.nullcontext([self.tensors[s.local_name] for s in specs])


class _Destinations:
    """vLLM tp shards held in memory (the rollout side); optionally zero-copy."""

    def __init__(self, specs: list[ShardSpec], *, zero_copy: bool) -> None:
        import torch

        self.specs = specs
        self.params = {s.local_name: torch.zeros(s.local_shape) for s in specs}
        self.zero_copy = zero_copy
        self.weight_version = 0

    def weight_targets(self) -> list[ShardSpec]:
        return self.specs

    def begin_weight_update(self, version: int) -> None:
        self._pending = version

    def weight_buffers(self, specs: list[ShardSpec]) -> list[torch.Tensor] | None:
        return [self.params[s.local_name] for s in specs] if self.zero_copy else None

    def load_weights(self, items: list[tuple[ShardSpec, torch.Tensor]]) -> None:
        for spec, tensor in items:
            param = self.params[spec.local_name]
            if tensor.data_ptr() != param.data_ptr():
                param.copy_(tensor)

    def finish_weight_update(self) -> None:
        self.weight_version = self._pending


def _checksums(specs: list[ShardSpec], tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per HF tensor, the float64 sum of its elements, each region counted once.

    A region is counted once even where several ranks hold it (replicated norms, or a
    vLLM `qkv_proj` whose KV heads are replicated while its query heads are not — such a
    spec is a replica as a whole, yet its query pieces exist nowhere else).
    """
    sums: dict[str, float] = {}
    seen: set[tuple[str, str]] = set()
    for spec in specs:
        for p in spec.pieces:
            if (p.name, str(p.global_box)) in seen:
                continue
            seen.add((p.name, str(p.global_box)))
            value = float(tensors[spec.local_name][p.local_box.slices()].double().sum())
            sums[p.name] = sums.get(p.name, 0.0) + value
    return sums


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark and returns the JSON report."""
    import torch

    from peerflow.models import megatron_layout
    from peerflow.models.vllm import tp_prefixed_layout
    from peerflow.reshard import WeightSyncService, plan_reshard

    torch.set_num_threads(args.threads)
    config = model_config(args.target_gb, args.hidden, args.vocab)
    src_specs = tp_prefixed_layout(config, 2, builder=megatron_layout)
    dst_specs = tp_prefixed_layout(config, 4)
    start = time.perf_counter()
    plan = plan_reshard({0: src_specs}, {0: dst_specs})
    plan_s = time.perf_counter() - start
    bucket_bytes = int(args.bucket_mb * 2**20)
    sources = _Sources(src_specs)
    zero_copy = _Destinations(dst_specs, zero_copy=True)
    staged = _Destinations(dst_specs, zero_copy=False)
    flat_src = torch.rand(plan.bytes // 4)
    flat_dst = torch.empty_like(flat_src)
    services = {name: WeightSyncService.build(sources, dest, plan=plan, transport="inprocess",
                                              bucket_bytes=bucket_bytes)
                for name, dest in (("reshard", zero_copy), ("staged", staged))}
    samples: dict[str, list[float]] = {"memcpy": [], "reshard": [], "staged": []}
    peaks: dict[str, int] = {"reshard": 0, "staged": 0}
    # Run 0 warms up (first-touch page faults, plugin loading) and is not timed.
    for version in range(max(1, args.runs) + 1):
        start = time.perf_counter()
        flat_dst.copy_(flat_src)
        elapsed = {"memcpy": time.perf_counter() - start}
        for name, service in services.items():
            start = time.perf_counter()
            stats = service.sync(version)
            elapsed[name] = time.perf_counter() - start
            peaks[name] = max(peaks[name], stats.peak_extra_bytes)
        if version:
            for name, seconds in elapsed.items():
                samples[name].append(seconds)
    want = _checksums(src_specs, sources.tensors)
    for name, dest in (("reshard", zero_copy), ("staged", staged)):
        got = _checksums(dst_specs, dest.params)
        bad = sorted(n for n in want if abs(got.get(n, math.inf) - want[n]) >
                     1e-9 * max(1.0, abs(want[n])))
        if bad:
            raise AssertionError(f"{name}: resharded values differ from the sources for "
                                 f"{bad[:3]} ({len(bad)} tensors)")
    largest = max(s.numel * 4 for s in dst_specs)
    gbps = {k: plan.bytes / statistics.median(v) / 1e9 for k, v in samples.items()}
    return {
        "reshard_gbps": round(gbps["reshard"], 3),
        "memcpy_gbps": round(gbps["memcpy"], 3),
        "ratio": round(gbps["reshard"] / gbps["memcpy"], 3),
        "peak_extra_bytes": max(peaks.values()),
        "bucket_bytes": bucket_bytes,
        "largest_piece_bytes": largest,
        "peak_bound_bytes": 2 * bucket_bytes + largest,
        "within_bound": max(peaks.values()) <= 2 * bucket_bytes + largest,
        "staged": {"reshard_gbps": round(gbps["staged"], 3),
                   "ratio": round(gbps["staged"] / gbps["memcpy"], 3),
                   "peak_extra_bytes": peaks["staged"]},
        "zero_copy_peak_extra_bytes": peaks["reshard"],
        "bytes": plan.bytes,
        "params": sum(math.prod(p.global_shape) for p in {
            piece.name: piece for s in src_specs for piece in s.pieces}.values()),
        "layout": "megatron tp2 (interleaved linear_qkv, fused linear_fc1) -> "
                  "vllm tp4 (qkv_proj, gate_up_proj), one process",
        "model": config,
        "plan_s": round(plan_s, 3),
        "transfers": len(plan.transfers),
        "threads": args.threads,
        "runs": {k: [round(t, 4) for t in v] for k, v in samples.items()},
        "median_of": len(samples["memcpy"]),
    }
