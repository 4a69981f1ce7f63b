"""One train step of a trainer, padded vs padding-free micro-batches, side by side.

The chosen trainer (`--trainer fsdp|deepspeed`, one process, the rank's device) trains on
one GRPO-shaped batch: `--prompts` prompts of the shape's prompt length, `--group-size`
answers each with long-tailed lengths (geometric, mean ≈ 128 tokens — the untrained bench
model's EOS rate, `peerflow.bench.shapes` — capped at the shape's answer cap), random
advantages, PPO's clipped loss at T = 0.7. The same batch is stepped with
`trainer.padding_free: false` and `true` (each after one warm-up step); per layout:

* `step_s`: median seconds of `train_step` over `--repeats` runs;
* `tokens_per_s`: the batch's real tokens (prompt + answer of every sample) / `step_s`;
* `positions`: positions the forward and backward ran over (`padded_tokens`);
* `padding_fraction`: the share of those positions that are padding (a prompt's
  samples share one copy of it in both layouts, so the unique tokens are the
  padding-free layout's positions);
* `peak_memory_gib`: the step's peak (device memory on an accelerator, the process's
  resident set on the CPU: `peerflow.training.memory`, as a run's `memory/peak_*`);
* `mfu` (CUDA only): 6 x parameters x unique tokens / `step_s` / the device's dense bf16
  peak (`peerflow.bench.mfu`; null with the reason for a device not in its table).

`speedup` is padding-free over padded tokens/s. `--activation-checkpointing` and `--bf16`
measure the memory controls on the same batch; `--attn-implementation` (fsdp) the
attention the model is loaded with (padding-free costs `T²` under sdpa, `Σ L_i²` under
flash-attention).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

import attrs

from peerflow.bench.mfu import train_mfu
from peerflow.bench.shapes import (
    BENCH_MODEL,
    GENERATION,
    MODEL_OPTIONS,
    add_shape_argument,
    build_model,
    length_stats,
    pick,
    prompt_ids,
)

TEMPERATURE = 0.7
#: The untrained bench model samples EOS with probability ≈ 1/128 at every step.
EOS_RATE = 1 / 128
#: `--shape quickstart`'s model: small enough for a smoke run on a busy CPU.
QUICKSTART_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                    "num_heads": 4, "num_kv_heads": 2}
if TYPE_CHECKING:
    import torch

LAYOUTS = {"padded": False, "padding_free": True}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options (counts default to the `--shape`'s)."""
    add_shape_argument(parser)
    parser.add_argument("--trainer", default="fsdp", help="train engine (fsdp, deepspeed)")
    parser.add_argument("--model", help="HF model directory (default: build the bench model)")
    for name in MODEL_OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            help=f"bench model option (realistic default {BENCH_MODEL[name]})")
    parser.add_argument("--prompts", type=int, help="prompts (default 4; quickstart 2)")
    parser.add_argument("--group-size", type=int, default=8, help="answers per prompt")
    parser.add_argument("--prompt-tokens", type=int, help="tokens per prompt (shape's)")
    parser.add_argument("--max-tokens", type=int, help="answer cap (shape's)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192,
                        help="trainer.micro_batch_tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--dtype", default="float32", help="model dtype (float32, bfloat16)")
    parser.add_argument("--bf16", action="store_true", help="trainer.bf16: true")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="trainer.activation_checkpointing: true")
    parser.add_argument("--attn-implementation",
                        help="transformers attention (fsdp: sdpa, eager, flash_attention_2, …)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, metavar="R",
                        help="train LoRA adapters of rank R (trainer.lora, all-linear, alpha "
                        "2R) instead of every weight; compare peak_memory_gib with a run "
                        "without it (default 0: full fine-tuning)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Steps both layouts on one batch; returns medians, ratios and every run's times."""
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="peerflow-bench-train-") as tmp:
        model = args.model or build_model(tmp, _model_overrides(args))
        batch, answer_lengths = bench_batch(model, args)
        real = int(batch.token_count().sum())
        layouts = {name: _measure(model, batch, args, padding_free=flag)
                   for name, flag in LAYOUTS.items()}
        params = parameter_count(model)
    unique = layouts["padding_free"]["positions"] / (args.repeats + 1)
    device = layouts["padded"].pop("device")
    layouts["padding_free"].pop("device")
    for figures in layouts.values():
        figures["tokens_per_s"] = real / figures["step_s"]
        per_step = figures["positions"] / (args.repeats + 1)
        figures["padding_fraction"] = max(0.0, 1 - unique / per_step)
        figures.update(_mfu(params, unique, figures["step_s"], device))
    return {
        "benchmark": "train", "shape": args.shape, "trainer": args.trainer,
        "device": device, "parameters": params, "samples": len(batch),
        "real_tokens": real, "unique_tokens": int(unique),
        "answer_lengths": length_stats(answer_lengths, _shape(args)[2]),
        "settings": {"micro_batch_tokens": args.micro_batch_tokens, "dtype": args.dtype,
                     "attn_implementation": args.attn_implementation or "default",
                     "lora_rank": args.lora_rank,
                     "bf16": args.bf16, "activation_checkpointing": args.activation_checkpointing,
                     "temperature": TEMPERATURE},
        "layouts": layouts,
        "speedup": layouts["padded"]["step_s"] / layouts["padding_free"]["step_s"],
        "median_of": args.repeats,
    }


def _shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prompts, prompt tokens, answer cap) from the options and the shape."""
    _, prompt_tokens, cap = GENERATION[args.shape]
    return (pick(args.prompts, args.shape, 2, 4), pick(args.prompt_tokens, args.shape,
                                                       prompt_tokens, prompt_tokens),
            pick(args.max_tokens, args.shape, cap, cap))


def _model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    base = QUICKSTART_MODEL if args.shape == "quickstart" else {}
    given = {name: getattr(args, name) for name in MODEL_OPTIONS
             if getattr(args, name) is not None}
    return {**base, **given}


def bench_batch(model: str, args: argparse.Namespace) -> tuple[Any, list[int]]:
    """The GRPO-shaped batch (see the module docstring) and its answer lengths."""
    import torch
    from transformers import AutoConfig

    from peerflow.batch import Batch, RaggedField

    prompts, prompt_tokens, cap = _shape(args)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    rng = random.Random(args.seed)
    count = prompts * args.group_size
    lengths = [min(cap, 1 + int(math.log(1 - rng.random()) / math.log(1 - EOS_RATE)))
               for _ in range(count)]
    heads = prompt_ids(model, prompts, prompt_tokens, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    batch = Batch(sample_id=torch.arange(count),
                  group_id=torch.arange(count) // args.group_size,
                  weight_version=torch.zeros(count, dtype=torch.int64))
    batch.set("prompt_ids", [torch.tensor(heads[i // args.group_size]) for i in range(count)])
    batch.set("response_ids", [torch.randint(3, vocab, (n,), generator=g) for n in lengths])
    offsets = batch.ragged("response_ids").offsets
    batch.set("advantages", RaggedField(values=torch.randn(int(offsets[-1]), generator=g),
                                        offsets=offsets))
    return batch, lengths


def _measure(model: str, batch: Any, args: argparse.Namespace, *,
             padding_free: bool) -> dict[str, Any]:
    """Warm-up step, then `--repeats` timed steps of one layout."""
    import torch

    from peerflow.algorithms.losses import PPOClip
    from peerflow.training.memory import GIB, peak_bytes, reset_peak

    engine = _engine(model, args, padding_free=padding_free)
    loss = PPOClip()
    micro_batches = len(engine.plan_micro_batches(batch))
    times, positions, peaks = [], 0, []
    for k in range(args.repeats + 1):
        _sync(engine.device)
        reset_peak(engine.device)
        start = time.perf_counter()
        metrics = engine.train_step(batch, loss)
        _sync(engine.device)
        if k:
            times.append(time.perf_counter() - start)
        positions += int(metrics["padded_tokens"])
        peaks.append(peak_bytes(engine.device) / GIB)
    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" \
        else str(engine.device)
    engine.shutdown()
    return {"step_s": statistics.median(times), "runs_s": times, "positions": positions,
            "micro_batches": micro_batches, "peak_memory_gib": max(peaks),
            "device": device}


def _engine(model: str, args: argparse.Namespace, *, padding_free: bool) -> Any:
    from peerflow.distributed.devices import rank_device
    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.layout import ParallelLayout
    from peerflow.plugins import get_plugin_manager

    cls = get_plugin_manager().registry("train_engine").get(args.trainer)
    lora = None
    if args.lora_rank:
        from peerflow.engines.lora import LoraConfig

        lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    context = EngineContext(model_path=model, layout=ParallelLayout(), dtype=args.dtype,
                            temperature=TEMPERATURE, device=str(rank_device()),
                            seed=args.seed, lora=lora)
    optim = OptimSettings(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens,
                          bf16=args.bf16, padding_free=padding_free,
                          activation_checkpointing=args.activation_checkpointing)
    options: dict[str, Any] = {}
    if args.attn_implementation:
        if "attn_implementation" not in attrs.fields_dict(cls.options_class):
            raise SystemExit(f"--attn-implementation: the {args.trainer} trainer has no "
                             "attn_implementation option; leave it out.")
        options["attn_implementation"] = args.attn_implementation
    return cls(context, cls.options_class(**options), optim)


def _sync(device: torch.device) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def parameter_count(model: str) -> int:
    """Parameters of the model at `model` (built on the meta device, tied weights once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in module.parameters())


def _mfu(params: int, tokens: float, seconds: float, device: str) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"mfu": None, "mfu_reason": "MFU is measured on a CUDA device only"}
    mfu, why = train_mfu(params, tokens, seconds, device)
    return {"mfu": None if mfu is None else round(mfu, 4),
            "mfu_reason" if mfu is None else "mfu_peak": why}
