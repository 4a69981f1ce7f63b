"""Routing replay against a real rollout/trainer mismatch: the same batch scored off and r3.

A tiny Qwen3-MoE (the tiny-model builder; 6 layers by default) samples a batch with the
`--rollout` engine (`hf`, or `vllm` where it declares `Capabilities.routed_experts`) in
`--rollout-dtype` (bfloat16 by default) at `--temperature`, returning every token's
experts (`routes` counts the samples with routes and their fed tokens without one).
The train engine (`--trainer`, float32) then scores the same tokens twice, in one run:
with native routing (`off`) and replaying the rollout's routes (`r3`). For each it
reports the mean |rollout − trainer log-prob| of the sampled tokens, the KL estimate
`mean(lp_rollout − lp_trainer)`, and the controller's agreement figures
(`moe/replay_no_overlap`, `moe/replay_changed`). Deterministic for a seed; nothing is
timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

#: Rollout engine options of the bench: vLLM takes a fifth of a GPU (it shares one with the
#: trainer, and with other checks in the GPU kit) and the model's 128 positions.
_ROLLOUT_OPTIONS = {"vllm": {"gpu_memory_utilization": 0.2, "max_model_len": 128}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    parser.add_argument("--trainer", default="fsdp",
                        help="train engine (fsdp, deepspeed, megatron)")
    parser.add_argument("--rollout", default="hf", choices=("hf", "vllm"),
                        help="rollout engine that samples and returns routes (default hf; "
                        "vllm needs Capabilities.routed_experts: Model Runner V2 on a GPU)")
    parser.add_argument("--rollout-dtype", default="bfloat16",
                        help="dtype of the rollout engine (default bfloat16)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=6,
                        help="decoder layers (default 6: a flipped route disturbs every later "
                        "layer, so depth is where routing mismatch shows; docs/benchmarks.md)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts (default 32)")
    parser.add_argument("--n", type=int, default=4, help="answers per prompt (default 4)")
    parser.add_argument("--max-tokens", type=int, default=12, help="answer cap (default 12)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling and scoring temperature (default 0.7)")
    parser.add_argument("--init", type=float, default=0.3,
                        help="initializer_range of the random model (default 0.3)")
    parser.add_argument("--device", default="cpu",
                        help="where both engines compute: cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Samples once, scores off and r3, and returns the figures (see the module docstring)."""
    model = _model(args)
    batch, rollout_logprobs, coverage = _sample(model, args)
    result: dict[str, Any] = {
        "model": {"family": "qwen3_moe", "experts": args.experts, "top_k": args.top_k,
                  "hidden": args.hidden, "layers": args.layers},
        "rollout": {"engine": args.rollout, "dtype": args.rollout_dtype,
                    "temperature": args.temperature},
        "routes": coverage,
        "device": args.device,
        "trainer": {"engine": args.trainer, "dtype": "float32"},
        "samples": len(batch), "sampled_tokens": int(rollout_logprobs.values.numel()),
        "repetitions": 1,
    }
    for mode in ("off", "r3"):
        result[mode] = _score(model, batch, rollout_logprobs, mode, args)
    result["abs_diff_ratio_off_over_r3"] = (
        result["off"]["mean_abs_logprob_diff"] / max(result["r3"]["mean_abs_logprob_diff"], 1e-30))
    return result


def _model(args: argparse.Namespace) -> str:
    """The tiny Qwen3-MoE, from the one tiny-model builder (`bench.shapes.build_model`)."""
    from peerflow.bench.shapes import build_model

    return build_model(tempfile.gettempdir() + "/peerflow-bench-moe", {
        "model_type": "qwen3_moe", "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 4, "num_layers": args.layers, "num_heads": 2,
        "num_kv_heads": 2, "num_experts": args.experts, "num_experts_per_tok": args.top_k,
        "initializer_range": args.init, "seed": args.seed, "max_position_embeddings": 128,
        "reserved_tokens": 0})


def _sample(model: str, args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    from peerflow.batch import Batch, RaggedField
    from peerflow.engines import EngineContext, GenerationRequest, SamplingParams
    from peerflow.layout import ParallelLayout
    from peerflow.plugins import get_plugin_manager
    from peerflow.routes import ROUTES, routes_column

    cls = get_plugin_manager().get("rollout_engine", args.rollout)
    context = EngineContext(model_path=model, layout=ParallelLayout(), dtype=args.rollout_dtype,
                            seed=args.seed, device=args.device, routed_experts=True)
    engine = cls(context, cls.options_class(**_ROLLOUT_OPTIONS.get(args.rollout, {})))
    gen = torch.Generator().manual_seed(args.seed)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    requests = [GenerationRequest(request_id=i, prompt_ids=torch.randint(
        2, vocab, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen).tolist())
        for i in range(args.prompts)]
    sampling = SamplingParams(n=args.n, max_tokens=args.max_tokens, seed=args.seed,
                              temperature=args.temperature)
    try:
        results = engine.generate(requests, sampling)
    finally:
        engine.shutdown()
    prompts = [requests[r.request_id].prompt_ids for r in results]
    batch = Batch(sample_id=range(len(results)), group_id=[r.request_id for r in results],
                  weight_version=[0] * len(results))
    batch.set("prompt_ids", RaggedField.from_lists(prompts, torch.int64))
    batch.set("response_ids", RaggedField.from_lists([r.token_ids for r in results],
                                                     torch.int64))
    batch.set(ROUTES, routes_column(results, [len(p) for p in prompts]))
    return (batch, RaggedField.from_lists([r.logprobs for r in results], torch.float32),
            _coverage(results))


def _coverage(results: Any) -> dict[str, int]:
    """How many samples carry routes, and their fed tokens without one on a routed layer.

    Every token but a sample's last sampled one is fed to the model, so it has a route on
    every layer with a router (a layer where some token has one).
    """
    with_routes = [r.routed_experts for r in results if r.routed_experts is not None]
    missing = 0
    for routes in with_routes:
        fed = routes[:-1]
        routed = (routes >= 0).any(dim=(0, 2))
        missing += int((fed[:, routed] < 0).any(dim=(1, 2)).sum())
    return {"samples": len(results), "samples_with_routes": len(with_routes),
            "fed_tokens_without_route": missing}


def _score(model: str, batch: Any, rollout: Any, mode: str,
           args: argparse.Namespace) -> dict[str, float]:
    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.layout import ParallelLayout
    from peerflow.plugins import get_plugin_manager

    cls = get_plugin_manager().get("train_engine", args.trainer)
    context = EngineContext(model_path=model, layout=ParallelLayout(), seed=args.seed,
                            temperature=args.temperature, device=args.device)
    trainer = cls(context, None, OptimSettings(routing_replay=mode))
    scored = trainer.forward_logprobs(batch)
    diff = rollout.values - scored.values.to(rollout.values.device)
    figures = {"mean_abs_logprob_diff": float(diff.abs().mean()),
               "max_abs_logprob_diff": float(diff.abs().max()),
               "kl_k1": float(diff.mean())}
    if trainer.routing is not None:
        metrics = trainer.routing.step_metrics(batch)
        figures.update({k: v for k, v in metrics.items() if "/layer_" not in k})
    return figures
