"""Tiny model shapes the suite tests layouts and engines with.

`LAYOUT_MODELS` (layers 1–2) cover the matrix the issue asks for — GQA ratios 1, 4 and
MQA, tied and untied embeddings, dense and MoE (Qwen3-MoE, Mixtral, GPT-OSS), biases and
q/k norms — with shapes small enough that a few hundred reshards run in seconds.
`ENGINE_MODELS` (layer 3) are real checkpoints written to disk with a character
tokenizer, so engines load them like any Hugging Face model directory; `qwen3moe-untied`
is the mixture-of-experts one (adapters not listing `qwen3_moe` in
`conformance_families()` skip it).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from peerflow.models import ModelShape

_BASE = dict(vocab_size=70, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             head_dim=4, max_position_embeddings=64)

#: id → HF config dict, for layout invariants and CPU round trips.
LAYOUT_MODELS: dict[str, dict[str, Any]] = {
    "llama-mha-untied": dict(_BASE, model_type="llama", num_attention_heads=4,
                             num_key_value_heads=4, tie_word_embeddings=False),
    "qwen3-gqa4-tied": dict(_BASE, model_type="qwen3", num_attention_heads=8,
                            num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-mqa-untied": dict(_BASE, model_type="qwen2", num_attention_heads=4,
                             num_key_value_heads=1, tie_word_embeddings=False),
    "qwen3moe-gqa2-untied": dict(_BASE, model_type="qwen3_moe", num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=False,
                                 num_experts=4, moe_intermediate_size=8,
                                 decoder_sparse_step=1, num_experts_per_tok=2),
    # Checkpoint names differ from the modules' (`block_sparse_moe`, w1/w3/w2).
    "mixtral-gqa2-untied": dict(_BASE, model_type="mixtral", num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=False,
                                num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=None),
    # Packed biased experts in the checkpoint, attention sinks, biased attention.
    "gptoss-gqa2-untied": dict(_BASE, model_type="gpt_oss", num_attention_heads=4,
                               num_key_value_heads=2, tie_word_embeddings=False,
                               num_local_experts=4, num_experts_per_tok=2,
                               layer_types=["full_attention"] * 2, sliding_window=64),
}

CHARS = "0123456789+-=abcdefghijklmnopqrstuvwxyz .,!?\n"

# head_dim 32: the smallest head size vLLM-CPU's attention backend supports.
_ENGINE_BASE = dict(vocab_size=len(CHARS) + 2, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                    bos_token_id=1)

#: id → HF config dict, for real-engine tests (written as checkpoints).
ENGINE_MODELS: dict[str, dict[str, Any]] = {
    "llama-tied": dict(_ENGINE_BASE, model_type="llama", tie_word_embeddings=True),
    "qwen2-untied": dict(_ENGINE_BASE, model_type="qwen2", tie_word_embeddings=False),
    "qwen3-tied": dict(_ENGINE_BASE, model_type="qwen3", tie_word_embeddings=True),
    # Every layer sparse; moe_intermediate_size differs from the expert count so the
    # router and an expert's projections never share a shape.
    "qwen3moe-untied": dict(_ENGINE_BASE, model_type="qwen3_moe", tie_word_embeddings=False,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
}


def hf_config(config: dict[str, Any]) -> Any:
    """Returns the `transformers` config object of a config dict (cached)."""
    return _hf_config(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _hf_config(text: str) -> Any:
    from transformers import AutoConfig

    values = json.loads(text)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def family(config: dict[str, Any]) -> str:
    """Returns the HF `model_type` of a config dict."""
    return ModelShape.from_hf_config(config).family


def model_family(model_id: str) -> str:
    """The HF `model_type` of a suite model id (a layout or engine model, else the id)."""
    return family(LAYOUT_MODELS.get(model_id) or ENGINE_MODELS.get(model_id) or
                  {"model_type": model_id})


def write_checkpoint(config: dict[str, Any], directory: str | Path, *, seed: int = 0) -> str:
    """Writes a randomly initialised checkpoint and a character tokenizer to `directory`.

    Weights are drawn with a fixed seed at a larger scale than the default init so
    log-probabilities differ clearly between two seeds.
    """
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(config))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:  # matrices and packed experts
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(directory))
    fast.save_pretrained(str(directory))
    return str(directory)
