"""Options of the `megatron` train engine (`trainer.megatron: {...}` in a run config)."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class MegatronOptions:
    """How the Megatron-core engine builds and optimises `GPTModel`.

    Tensor and pipeline degrees come from `trainer.layout` (`tp`, `pp`), not from here.
    """

    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (optimizer state sharded over dp). GPU only:
    megatron-core 0.16's optimizers require CUDA tensors; on CPU the engine uses
    `torch.optim.AdamW` on Megatron's DDP gradient buffers and this must stay `False`."""
    vocab_multiple: int = attrs.field(default=128, validator=attrs.validators.ge(1))
    """Megatron-LM's `make_vocab_size_divisible_by`: the vocabulary is padded to a multiple
    of `vocab_multiple * tp` rows; padded logits are masked out of every softmax."""
    overlap_grad_reduce: bool = False
    """Overlap the dp gradient all-reduce with backward (Megatron DDP; GPU)."""
    grad_reduce_in_fp32: bool = True
    """Keep DDP gradient buffers in float32 (matters with bf16 parameters)."""
