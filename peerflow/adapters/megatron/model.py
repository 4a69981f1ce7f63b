"""Building a Megatron-core `GPTModel` from a HF config (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral).

The HF config maps onto Megatron's `TransformerConfig`: RMSNorm, SwiGLU (`gated_linear_unit`
+ SiLU), grouped-query attention (`num_query_groups`), rotary embeddings (non-interleaved,
HF's `rotate_half`), Qwen2's q/k/v biases and Qwen3's per-head q/k norms. The layer spec is
Megatron's local (non-Transformer-Engine) spec, so parameter names are the ones
`peerflow.models.megatron_layout(te_names=False)` describes. The vocabulary is padded to
`vocab_multiple * tp` rows, as Megatron-LM does.

Qwen3-MoE and Mixtral map onto Megatron's own MoE layer: a `TopKRouter`
(`mlp.router.weight`, the checkpoint's `mlp.gate` / `block_sparse_moe.gate`),
`SequentialMLP` experts (one SwiGLU `linear_fc1`/`linear_fc2` per expert, the checkpoint's
experts one by one) split over `expert_model_parallel_size`, and the allgather token
dispatcher (the one that runs over gloo on the CPU). A renormalised top-k (Qwen3-MoE's
`norm_topk_prob`, Mixtral always: softmax over all experts, top-k, renormalised) is
Megatron's top-k of the logits with a softmax over the k chosen
(`moe_router_pre_softmax=False`); without it, the top-k of the full softmax (`True`).
Megatron's own aux loss stays off: the training toolkit's routing-replay controller
computes the load-balancing loss from the router logits (`trainer.router_aux_loss_coef`),
as for every trainer. Routers are built with `moe_enable_routing_replay`, the hook the
controller drives (`routing.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from peerflow.errors import ConfigError
from peerflow.models import ModelShape, padded_vocab

#: HF model types whose dense decoder maps onto `GPTModel` with the local layer spec.
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
#: MoE model types whose experts map onto Megatron's MoE layer (SequentialMLP experts).
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def check_supported(hf_config: Any) -> ModelShape:
    """Returns the model's `ModelShape`, raising `ConfigError` for what GPTModel cannot mirror."""
    shape = ModelShape.from_hf_config(hf_config)
    moe = shape.family in MOE_FAMILIES and shape.num_experts > 0
    if not moe and (shape.family not in SUPPORTED_FAMILIES or shape.num_experts):
        raise ConfigError(
            f"trainer.backend=megatron: model_type {shape.family!r} is not supported; "
            f"expected a dense model of {SUPPORTED_FAMILIES} or an MoE model of {MOE_FAMILIES}."
        )
    window = getattr(hf_config, "sliding_window", None)
    if moe and window is not None and getattr(hf_config, "use_sliding_window", True):
        raise ConfigError(
            f"trainer.backend=megatron: the {shape.family} model has sliding_window={window}; "
            "Megatron's attention here is full causal attention. Use a model with "
            "sliding_window: null, or the fsdp trainer."
        )
    if moe and len(shape.sparse_layers) != shape.num_layers:
        raise ConfigError(
            f"trainer.backend=megatron: the {shape.family} model has dense layers among its MoE "
            f"layers (sparse: {list(shape.sparse_layers)}); the adapter maps every-layer-sparse "
            "models only. Use decoder_sparse_step: 1 and mlp_only_layers: [], or the fsdp trainer."
        )
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in ("default", None):
        raise ConfigError(
            f"trainer.backend=megatron: rope_scaling type {rope_type!r} is not mapped onto "
            "Megatron's rotary embedding; use a model without rope scaling or the fsdp trainer."
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(
            f"trainer.backend=megatron: hidden_act={hf_config.hidden_act!r}; only SwiGLU "
            "(silu) MLPs are mapped."
        )
    return shape


def rope_theta(hf_config: Any) -> float:
    """Returns the rotary base of a HF config (old and new transformers spellings)."""
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def renormalises(hf_config: Any, shape: ModelShape) -> bool:
    """Whether the router renormalises its top-k weights (Mixtral always; Qwen by config)."""
    return shape.family == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", False))


def moe_settings(hf_config: Any, shape: ModelShape, ep: int) -> dict[str, Any]:
    """Megatron's MoE fields for an MoE `hf_config` (empty for a dense model)."""
    if not shape.num_experts:
        return {}
    return {
        "num_moe_experts": shape.num_experts,
        "moe_router_topk": int(hf_config.num_experts_per_tok),
        "moe_ffn_hidden_size": shape.moe_intermediate_size,
        "moe_router_pre_softmax": not renormalises(hf_config, shape),
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_enable_routing_replay": True,
        "expert_model_parallel_size": ep,
    }


def transformer_config(hf_config: Any, *, tp: int, pp: int, dtype: torch.dtype,
                       on_cpu: bool, ep: int = 1) -> Any:
    """Returns Megatron's `TransformerConfig` equivalent to `hf_config`.

    Args:
        hf_config: The HF config.
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        dtype: Parameter dtype.
        on_cpu: Initialise parameters on the CPU.
        ep: Expert-parallel size (MoE models).
    """
    from megatron.core.transformer import TransformerConfig

    shape = check_supported(hf_config)
    return TransformerConfig(
        **moe_settings(hf_config, shape, ep),
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        use_cpu_initialization=on_cpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
    )


def build_gpt_model(hf_config: Any, config: Any, *, tp: int, vocab_multiple: int,
                    pre_process: bool, post_process: bool) -> Any:
    """Builds this pipeline stage's `GPTModel` (random init; weights are imported after)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    shape = check_supported(hf_config)
    if shape.num_experts:
        _define_missing_te_gemm()
    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(shape.vocab_size, tp, vocab_multiple),
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf_config),
    )


def _define_missing_te_gemm() -> None:
    """Defines `moe_utils.te_general_gemm = None` where megatron-core left it undefined.

    megatron-core 0.16.1 without Transformer Engine never binds the name, yet the router's
    gating reads it (`te_general_gemm is not None`); `None` selects its `torch.mm` path.
    """
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mirror_padding_idx(model: Any, hf_config: Any) -> None:
    """Gives Megatron's word embedding the HF embedding's `padding_idx` gradient rule.

    Transformers builds `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`: the pad
    row (zeros at init) gets no gradient from the input lookup. Megatron's embedding has
    no such rule, and a sampled pad token's zero embedding then gets the RMSNorm's
    `1 / sqrt(eps)` gradient (hundreds, where every other row gets < 1). A hook on the
    lookup's output zeroes the gradient of the positions that read the pad row, which is
    exactly `padding_idx` (a tied output layer still trains the row, as in transformers).
    """
    pad = getattr(hf_config, "pad_token_id", None)
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if pad is None or embedding is None or not 0 <= int(pad) < int(hf_config.vocab_size):
        return

    def hook(module: Any, args: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            reads_pad = (args[0] == int(pad)).unsqueeze(-1)
            output.register_hook(lambda grad: grad.masked_fill(reads_pad, 0))

    embedding.register_forward_hook(hook)
