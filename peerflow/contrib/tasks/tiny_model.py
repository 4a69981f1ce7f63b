"""Builds a tiny causal LM and its tokenizer from a config, cached on disk.

The directory holds everything a Hugging Face loader (and vLLM) needs: `config.json`,
`model.safetensors`, the tokenizer files and `peerflow_builder.json` (the options that
made it). It lives at `<cache root>/<hash of the options>`, so the same options always
map to the same directory; a build writes into a temporary directory and renames it into
place, so processes racing to build the same model never see a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from peerflow.checkpoint.atomic import atomic_path

#: Bumped when the builder's output for the same options changes.
BUILDER_VERSION = 2
MARKER = "peerflow_builder.json"


def default_cache_root() -> Path:
    """`$PEERFLOW_MODEL_CACHE`, else `~/.cache/peerflow/models`."""
    env = os.environ.get("PEERFLOW_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "peerflow" / "models"


@attrs.frozen(kw_only=True)
class TinyModelOptions:
    """`model.builder_options`: the shape of the tiny model (defaults: ~0.5 M parameters)."""

    model_type: Literal["llama", "qwen2", "qwen3_moe", "mixtral", "gpt_oss"] = "llama"
    """Hugging Face architecture; `qwen3_moe`, `mixtral` and `gpt_oss` are mixtures of
    experts (`peerflow.models.moe_configs`: every layer sparse)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 512
    """Width of the MLP."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 4
    """Key/value heads (fewer than `num_heads` gives grouped-query attention)."""
    max_position_embeddings: int = 128
    """Longest prompt + answer the model accepts."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head."""
    extra_merges: int = 0
    """BPE merges beyond the task's characters (0: a character-level tokenizer)."""
    reserved_tokens: int = 0
    """Vocabulary entries beyond the task's (`<reserved_i>`, like a real tokenizer's
    reserved tokens). An untrained model samples close to uniformly over its vocabulary,
    so it ends an answer with EOS about once per vocabulary-size tokens: the benchmarks'
    realistic shape sets this for long-tailed, roughly geometric answer lengths."""
    seed: int = 0
    """Seed of the random initialisation."""
    vocab_size: int = 0
    """Embedding rows (0: the tokenizer's size; more pads them, as large models pad theirs)."""
    initializer_range: float = 0.02
    """Standard deviation of the initial weights (Hugging Face's `initializer_range`).
    Small values make the untrained model's next-token distribution nearly uniform, so
    EOS comes with probability ≈ 1 / vocabulary size at every step: geometric lengths."""
    num_experts: int = 4
    """MoE families: experts per layer."""
    num_experts_per_tok: int = 2
    """MoE families: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """MoE families: width of one expert's MLP (0: `intermediate_size // num_experts`)."""

    def __attrs_post_init__(self) -> None:
        if min(self.reserved_tokens, self.vocab_size) < 0 or self.initializer_range <= 0:
            raise ValueError(
                f"model.builder_options: reserved_tokens={self.reserved_tokens} and "
                f"vocab_size={self.vocab_size} must be >= 0, initializer_range="
                f"{self.initializer_range} > 0.")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.builder_options: hidden_size={self.hidden_size} must be divisible by "
                f"num_heads={self.num_heads}, and num_heads by num_kv_heads={self.num_kv_heads}."
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.builder_options: num_experts_per_tok={self.num_experts_per_tok} must be "
                f"in 1..num_experts={self.num_experts}.")


#: Options added after version 2, left out of the cache key at these defaults.
_ADDED_DEFAULTS: dict[str, Any] = {"reserved_tokens": 0, "vocab_size": 0,
                                    "initializer_range": 0.02, "num_experts": 4,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 0}


def cache_key(builder: str, corpus: Iterable[str], options: TinyModelOptions) -> str:
    """A stable 16-hex-digit key of everything that determines the built directory."""
    fields = attrs.asdict(options)
    for name, default in _ADDED_DEFAULTS.items():  # keep the keys of models built before
        if fields[name] == default:
            del fields[name]
    payload = json.dumps({
        "builder": builder, "version": BUILDER_VERSION, "corpus": sorted(set(corpus)),
        "options": fields,
    }, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_tiny_model(
    builder: str,
    corpus: Iterable[str],
    options: TinyModelOptions,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Returns the directory of the tiny model for `options`, building it if missing.

    Args:
        builder: Name of the task that builds it (part of the cache key).
        corpus: Text whose characters the tokenizer must cover.
        options: Model shape and seed.
        cache_dir: Cache root; `None` for `default_cache_root()`.
        log: Called with one line when a model is built.
    """
    corpus = list(corpus)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    target = root / cache_key(builder, corpus, options)
    if (target / MARKER).is_file():
        return target
    try:
        with atomic_path(target) as tmp:
            tmp.mkdir()
            _write_model(tmp, corpus, options)
            (tmp / MARKER).write_text(json.dumps(
                {"builder": builder, "version": BUILDER_VERSION, "options": attrs.asdict(options)},
                indent=1, sort_keys=True))
    except OSError:
        if not (target / MARKER).is_file():
            raise
        return target  # another process built it first
    if log is not None:
        log(f"built tiny model {builder} at {target}")
    return target


def _write_model(directory: Path, corpus: list[str], options: TinyModelOptions) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from peerflow.contrib.tasks.tokenizer import train_char_tokenizer

    tokenizer = train_char_tokenizer(corpus, options.extra_merges)
    tokenizer.add_tokens([f"<reserved_{i}>" for i in range(options.reserved_tokens)])
    config = AutoConfig.for_model(
        options.model_type,
        **_moe_kwargs(options),
        vocab_size=max(options.vocab_size, len(tokenizer)),
        hidden_size=options.hidden_size,
        num_hidden_layers=options.num_layers,
        num_attention_heads=options.num_heads,
        num_key_value_heads=options.num_kv_heads,
        max_position_embeddings=options.max_position_embeddings,
        initializer_range=options.initializer_range,
        tie_word_embeddings=options.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with _seeded(options.seed):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    # Name the generic fast-tokenizer class, which transformers 4.x and 5.x both load
    # (5.x would otherwise record its own `TokenizersBackend`, unknown to 4.x).
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2))


def _moe_kwargs(options: TinyModelOptions) -> dict[str, Any]:
    """The config keywords of the MLP: dense width, or a MoE family's experts."""
    from peerflow.models.moe_configs import MOE_FAMILIES, moe_config_kwargs

    if options.model_type not in MOE_FAMILIES:
        return {"intermediate_size": options.intermediate_size}
    width = options.moe_intermediate_size or options.intermediate_size // options.num_experts
    kwargs = moe_config_kwargs(
        options.model_type, num_layers=options.num_layers,
        head_dim=options.hidden_size // options.num_heads, num_experts=options.num_experts,
        top_k=options.num_experts_per_tok, expert_width=width,
        max_position_embeddings=options.max_position_embeddings)
    return {"intermediate_size": options.intermediate_size, **kwargs}


class _seeded:
    """Seeds torch's CPU generator for the block and restores its state afterwards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        import torch

        self.state = torch.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_rng_state(self.state)


def options_from_mapping(options: Mapping[str, Any]) -> TinyModelOptions:
    """Validates `model.builder_options` (strictly: unknown keys name the fix)."""
    from peerflow.config.structure import structure

    return structure(TinyModelOptions, dict(options), "model.builder_options")


def builder_option_problems(options: Mapping[str, Any]) -> list[str]:
    """`options_from_mapping`'s complaint as a list (what `check_builder_options` returns)."""
    from peerflow.errors import ConfigError

    try:
        options_from_mapping(options)
    except ConfigError as exc:
        return [str(exc)]
    return []
