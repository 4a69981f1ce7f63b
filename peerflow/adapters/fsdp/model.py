"""Building the trained module, optionally tensor-parallel and FSDP2-sharded.

The module is a causal LM (actor, reference) or an LM backbone with a value head
(critic); `parallelize_module` shards its blocks over tp, `fully_shard` over dp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from peerflow.errors import ConfigError


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head: PPO's critic.

    Parameter names follow transformers' `*ForTokenClassification` (`model.*`, `score.*`),
    so the backbone loads from any causal-LM checkpoint of the same architecture.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.model = backbone
        self.score = nn.Linear(hidden_size, 1)
        # A zero head starts every value at 0: the first GAE advantages equal the returns.
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)
        self.config = backbone.config
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Returns `[batch, seq]` values, one per position."""
        # No cache: transformers reads packed samples from position ids only without one.
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False).last_hidden_state
        return self.score(hidden.to(self.score.weight.dtype)).squeeze(-1)


def load_module(
    path: str, *, value_head: bool, dtype: torch.dtype, attn_implementation: str | None
) -> nn.Module:
    """Loads the HF model at `path` as a causal LM or as a `ValueModel`."""
    from transformers import AutoModel, AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if not value_head:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    backbone = AutoModel.from_pretrained(path, **kwargs)
    return ValueModel(backbone, backbone.config.hidden_size).to(dtype)


def block_modules(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks (transformers' `_no_split_modules` classes), in order."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


#: Megatron-style plan for Llama-family blocks: column-parallel q/k/v and gate/up,
#: row-parallel o and down, so each block needs one all-reduce in attention and one in MLP.
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any) -> None:
    """Shards every block's attention and MLP projections over `tp_mesh` (in place).

    Embeddings, norms and the LM head stay replicated on the tp mesh (they are small next
    to the blocks for the models this reference engine targets).

    Raises:
        ConfigError: The heads do not divide by the tp degree, or a block is not
            Llama-shaped (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`).
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    config = module.config
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        count = getattr(config, what, None)
        if count is not None and count % tp:
            raise ConfigError(
                f"trainer.layout.tp={tp} does not divide the model's {what}={count}; choose "
                "a tp that divides it."
            )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in block_modules(module):
        submodules = dict(block.named_modules())
        missing = [name for name in TP_PLAN if name not in submodules]
        if missing:
            raise ConfigError(
                f"fsdp tensor parallelism supports Llama-shaped blocks; "
                f"{type(block).__name__} has no {missing}. Use trainer.layout.tp=1."
            )
        plan = {}
        for name, style in TP_PLAN.items():
            plan.update(_lora_aware(name, style, submodules[name]))
        parallelize_module(block, tp_mesh, {k: styles[v]() for k, v in plan.items()})


def _lora_aware(name: str, style: str, module: nn.Module) -> dict[str, str]:
    """The tp plan of one projection; a peft LoRA layer splits with its base layer.

    Column-parallel: the base layer and `B` split their outputs (the adapter's update is
    added to the base's output shard), `A` is replicated. Row-parallel: the base layer and
    `A` split their inputs (each output all-reduced), `B` is replicated. DTensor reduces
    the replicated factor's gradient where it is partial.
    """
    if not hasattr(module, "base_layer"):
        return {name: style}
    split = "lora_B" if style == "colwise" else "lora_A"
    return {f"{name}.base_layer": style,
            **{f"{name}.{split}.{adapter}": style for adapter in getattr(module, split)}}


def apply_fsdp(module: nn.Module, dp_mesh: Any, *, param_dtype: torch.dtype | None,
               reduce_dtype: torch.dtype | None, cpu_offload: bool,
               reshard_after_forward: bool) -> None:
    """Shards every block, then the root, with FSDP2 over `dp_mesh` (in place).

    Args:
        module: The model.
        dp_mesh: The data-parallel mesh.
        param_dtype: `MixedPrecisionPolicy.param_dtype`: the dtype gathered parameters
            compute in (`None`: the parameters' own).
        reduce_dtype: `MixedPrecisionPolicy.reduce_dtype`: the dtype gradients are
            reduce-scattered in (`None`: `param_dtype`'s).
        cpu_offload: Keep sharded parameters, gradients and the optimiser step on the
            host (`CPUOffloadPolicy`), gathered to the device for each block.
        reshard_after_forward: Free gathered parameters after forward.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    extra: dict[str, Any] = {}
    if cpu_offload:
        pin = dp_mesh.device_type == "cuda"
        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    for block in block_modules(module):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward, **extra)
    fully_shard(module, mesh=dp_mesh, mp_policy=policy,
                reshard_after_forward=reshard_after_forward, **extra)
