"""Benchmark shapes: `--shape quickstart` (each benchmark's small default) and `realistic`.

The realistic shape is one definition every throughput benchmark uses: the ~50 M-parameter
Llama of `BENCH_MODEL` (hidden 768, 8 layers, GQA 12/4, MLP 2048), prompts of about
`PROMPT_TOKENS` tokens (the `reverse-digits` task with `DIGITS` digits) and answers of up
to `MAX_TOKENS` tokens with a long-tailed length distribution.

Where the lengths come from: an untrained model rarely decides to stop, and per-request
token budgets are not something TRL or every engine can honour, so the length
distribution is a property of the model itself. `BENCH_MODEL` adds `reserved_tokens` to
the character vocabulary (128 entries in all) and initialises the weights with a small
`initializer_range`, so the untrained model's next-token distribution is nearly uniform
and it samples EOS with probability ≈ 1/128 at every step: answer lengths are geometric
(mean ≈ 128, median ≈ 88, ≈ 2 % reach the 512 cap). Every engine and TRL sample from the
same weights, so all honour the same distribution; each benchmark reports the lengths it
measured (`length_stats`).

Every model comes from the one tiny-model builder, reached through the registered
`reverse-digits` task (`build_model`), so rollout, weight-sync, async and e2e benchmark
the same weights for the same options.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SHAPES = ("quickstart", "realistic")
#: Task whose registered builder writes every benchmark model (and whose prompts the
#: training benchmarks use).
BUILDER_TASK = "reverse-digits"
#: `model.builder_options` of the ~50 M-parameter benchmark model.
BENCH_MODEL: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 2048, "num_layers": 8, "num_heads": 12,
    "num_kv_heads": 4, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    "reserved_tokens": 110, "initializer_range": 0.002,
}
#: The options that size a model (`--hidden-size` …, `weight-sync`'s `SIZES` columns).
MODEL_OPTIONS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
#: Digits of a realistic `reverse-digits` prompt: 127 digits + ">" (+ BOS) ≈ 128 tokens.
DIGITS = 127
PROMPT_TOKENS = DIGITS + 1
MAX_TOKENS = 512
#: Generation benchmarks' (prompts per call, tokens per prompt, answer cap) per shape.
GENERATION: dict[str, tuple[int, int, int]] = {
    "quickstart": (16, 32, 64), "realistic": (8, PROMPT_TOKENS, MAX_TOKENS)}


def add_shape_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--shape quickstart|realistic`."""
    parser.add_argument(
        "--shape", choices=SHAPES, default="quickstart",
        help="quickstart: the benchmark's small default; realistic: the ~50 M model, "
        f"~{PROMPT_TOKENS}-token prompts, long-tailed answers up to {MAX_TOKENS} tokens")


def pick(value: Any, shape: str, quickstart: Any, realistic: Any) -> Any:
    """`value` when given on the command line (not None), else the shape's default."""
    if value is not None:
        return value
    return realistic if shape == "realistic" else quickstart


def config_overrides(shape: str) -> list[str]:
    """`--set` items that turn a `reverse-digits` run config into the realistic shape.

    Empty for `quickstart` (the config as written). The config must build its model with
    a tiny-model builder (`model.builder`), as `examples/quickstart.yaml` does.
    """
    if shape != "realistic":
        return []
    return [f"model.builder={BUILDER_TASK}", f"task.name={BUILDER_TASK}",
            f"task.options.digits={DIGITS}", f"rollout.sampling.max_tokens={MAX_TOKENS}",
            *(f"model.builder_options.{key}={_yaml(value)}"
              for key, value in BENCH_MODEL.items())]


def build_model(directory: str | Path, overrides: Mapping[str, Any] | None = None) -> str:
    """Builds `BENCH_MODEL` (with `overrides`) under `directory` with the task's builder.

    Returns:
        The model directory (config, weights, tokenizer), as a string.
    """
    from peerflow.plugins import get_plugin_manager

    options = {**BENCH_MODEL, **(overrides or {})}
    task = get_plugin_manager().get("task", BUILDER_TASK)
    return str(task.build_model(options, str(directory)))


def prompt_ids(model: str | Path, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: random digit strings through the model's tokenizer."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = "".join(rng.choice("0123456789") for _ in range(4 * length))
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"][:length])
    return prompts


def length_stats(lengths: Sequence[int], cap: int) -> dict[str, float]:
    """Summary of answer lengths: mean, median, p90, max and the share that hit `cap`."""
    if not lengths:
        return {"count": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "max": 0,
                "capped_fraction": 0.0}
    ordered = sorted(lengths)
    return {
        "count": len(ordered),
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
        "capped_fraction": sum(n >= cap for n in ordered) / len(ordered),
    }


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
