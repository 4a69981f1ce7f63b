"""`ModelShape`: the facts about a Hugging Face model that shard layouts depend on.

Built from a `transformers` config (or its `dict` form) by `ModelShape.from_hf_config`;
the family modules (`llama`, `qwen2`, `qwen3`, `qwen3_moe`, `mixtral`, `gpt_oss`) say
which optional tensors a family has (attention biases, q/k norms, MoE experts and how
checkpoints name them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from peerflow.errors import ConfigError


@attrs.frozen(kw_only=True)
class ModelShape:
    """Shape facts of a decoder-only HF causal LM (Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral/GPT-OSS)."""

    family: str
    """HF `model_type` (`llama`, `qwen2`, `qwen3`, `qwen3_moe`)."""
    vocab_size: int
    """Rows of the embedding and LM head."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """Width of a dense MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (query groups); `num_heads % num_kv_heads == 0`."""
    head_dim: int
    """Per-head width."""
    tie_word_embeddings: bool = False
    """The LM head reuses `model.embed_tokens.weight` (no `lm_head.weight` tensor)."""
    qkv_bias: bool = False
    """q/k/v projections have biases (Qwen2; Llama/Qwen3 with `attention_bias`)."""
    o_bias: bool = False
    """The output projection has a bias (Llama/Qwen3 with `attention_bias`)."""
    mlp_bias: bool = False
    """Dense MLP projections have biases (Llama `mlp_bias`)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3: `self_attn.q_norm`, `k_norm`)."""
    num_experts: int = 0
    """MoE experts per sparse layer (0 for dense models)."""
    moe_intermediate_size: int = 0
    """Width of one expert's MLP."""
    sparse_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    """Indices of the layers whose MLP is a mixture of experts."""
    moe_block: str = "mlp"
    """Checkpoint name of a sparse layer's MoE module (Mixtral: `block_sparse_moe`)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Checkpoint names of one expert's gate, up and down projections (Mixtral: `w1`,
    `w3`, `w2`)."""
    packed_experts: bool = False
    """Checkpoints hold each layer's experts packed, as `transformers` does (GPT-OSS:
    `mlp.experts.gate_up_proj` `[E, H, 2I]` with gate and up interleaved, biases, and a
    biased `mlp.router`), not one tensor per expert."""
    attn_sinks: bool = False
    """Per-head attention sinks (`self_attn.sinks` `[num_heads]`, GPT-OSS)."""

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.family}: num_attention_heads={self.num_heads} is not a multiple "
                f"of num_key_value_heads={self.num_kv_heads}; fix the HF config."
            )

    @property
    def q_rows(self) -> int:
        """Rows of `q_proj.weight`."""
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        """Rows of `k_proj.weight` (and of `v_proj.weight`)."""
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        """Query heads per key/value head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has a MoE MLP."""
        return layer in self.sparse_layers

    def router_name(self, layer: int) -> str:
        """Checkpoint name of sparse layer `layer`'s router weight."""
        router = "router" if self.packed_experts else "gate"
        return f"model.layers.{layer}.{self.moe_block}.{router}.weight"

    def expert_tensor(self, layer: int, expert: int, which: int) -> str:
        """Checkpoint name of one expert's projection: `which` 0 gate, 1 up, 2 down.

        Raises:
            ConfigError: the family's checkpoints pack their experts (`packed_experts`).
        """
        if self.packed_experts:
            raise ConfigError(f"model {self.family}: checkpoints hold experts packed; there is "
                              "no per-expert tensor name.")
        return (f"model.layers.{layer}.{self.moe_block}.experts.{expert}."
                f"{self.expert_names[which]}.weight")

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Reads a `transformers.PretrainedConfig`, a config `dict`, or a `ModelShape`.

        Raises:
            ConfigError: the `model_type` has no family module here.
        """
        if isinstance(config, ModelShape):
            return config
        get = _getter(config)
        family = get("model_type", None)
        builder = _FAMILIES.get(family)
        if builder is None:
            raise ConfigError(
                f"model_type {family!r} has no layout family in peerflow.models; supported: "
                f"{sorted(_FAMILIES)}. Add a family module or use a supported model."
            )
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        base: dict[str, Any] = dict(
            family=family,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", None) or heads),
            head_dim=int(get("head_dim", None) or hidden // heads),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )
        base.update(builder(get))
        return cls(**base)


Getter = Callable[..., Any]
_MISSING = object()


def _getter(config: Any) -> Getter:
    def get(key: str, default: Any = _MISSING) -> Any:
        if isinstance(config, Mapping):
            value = config.get(key, default)
        else:
            value = getattr(config, key, default)
        if value is _MISSING:
            raise ConfigError(f"HF config {type(config).__name__} lacks {key!r}.")
        return value

    return get


_FAMILIES: dict[str, Callable[[Getter], dict[str, Any]]] = {}


def register_family(model_type: str, builder: Callable[[Getter], dict[str, Any]]) -> None:
    """Registers how a `model_type` fills the family-specific `ModelShape` fields."""
    _FAMILIES[model_type] = builder


def model_type_at(model_path: str | None) -> str | None:
    """The `model_type` of the HF model directory `model_path` (`None` without config.json)."""
    path = Path(model_path or "") / "config.json"
    return json.loads(path.read_text()).get("model_type") if model_path and path.is_file() \
        else None
