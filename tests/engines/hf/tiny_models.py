"""Tiny causal LMs (hidden 64, 2 layers) with a character-level tokenizer, no hub."""

from __future__ import annotations

CHARS = "0123456789+-=abcdefghijklmnopqrstuvwxyz .,!?\n"


def build_tiny_model(directory, *, tied: bool = True, arch: str = "llama", seed: int = 0,
                     hidden_size: int = 64, intermediate_size: int = 128,
                     num_experts: int = 4, top_k: int = 2) -> str:
    """Writes a randomly initialised tiny causal LM and a char tokenizer to `directory`.

    4 query heads and 2 key/value heads, so `hidden_size` sets the head size
    (`hidden_size // 4`). `arch` is `llama`, `qwen2`, or a MoE family of
    `peerflow.models.moe_configs.MOE_FAMILIES` (`num_experts` experts of width
    `intermediate_size // 2`, `top_k` per token, every layer sparse).
    """
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from peerflow.models.moe_configs import MOE_FAMILIES, moe_config_kwargs

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    moe = {}
    if arch in MOE_FAMILIES:
        moe = moe_config_kwargs(arch, num_layers=2, head_dim=hidden_size // 4,
                                num_experts=num_experts, top_k=top_k,
                                expert_width=intermediate_size // 2, max_position_embeddings=256)
    shape = dict(
        vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=tied, pad_token_id=0,
        eos_token_id=1, bos_token_id=1,
    )
    config = AutoConfig.for_model(arch, **{**shape, **moe})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Larger weights than the default init make sampled answers varied and peaked enough
    # for stop strings and EOS to fire within a few tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return str(directory)


