"""Every trainer setting, written once: the `trainer:` section and what train engines read.

`OptimSettings` holds each setting with its one default, type, validator and docstring.
The run config's `TrainerConfig` (`peerflow.config.engines`) is a subclass that adds what
selects and places the engine (`backend`, `layout`, `lora`, the per-backend sections), so
`trainer.lr` in YAML and `optim.lr` in an adapter are the same field; the runtime hands an
engine `TrainerConfig.optim_settings(steps)`, these fields with the run's length filled in.
An engine built directly (tests, conformance, benchmarks) gets the same defaults a run does.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import validators

#: Field metadata key of a setting the runtime fills in, never the user (its value says
#: from what); `peerflow.config.structure` refuses it in a config and leaves it out of dumps.
DERIVED = "peerflow_derived"


@attrs.frozen(kw_only=True)
class OptimSettings:
    """Optimiser and step settings shared by every train engine (the `trainer:` keys)."""

    lr: float = attrs.field(default=1e-6, validator=validators.gt(0.0))
    """Peak AdamW learning rate. 1e-6 (TRL's and verl's RL default) is safe for a
    pretrained model; tiny models trained from scratch need far more (the examples set
    1e-3)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up, over optimiser steps (`run.steps` x
    `mini_batches`): `constant`, or `linear` / `cosine` decay to `min_lr_ratio` x `lr`
    at the run's last step (docs/training.md; `peerflow.training.schedule`)."""
    warmup_steps: int = attrs.field(default=0, validator=validators.ge(0))
    """Optimiser steps of linear warm-up to `lr` (0: none)."""
    warmup_ratio: float = attrs.field(default=0.0, validator=[validators.ge(0.0),
                                                              validators.lt(1.0)])
    """Warm-up as a share of the run's optimiser steps, instead of `warmup_steps`."""
    min_lr_ratio: float = attrs.field(default=0.0, validator=[validators.ge(0.0),
                                                              validators.le(1.0)])
    """Floor of `linear` and `cosine`, a fraction of `lr` (their warm-up starts there)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = attrs.field(default=1e-8, validator=validators.gt(0.0))
    """AdamW epsilon."""
    grad_clip: float = attrs.field(default=1.0, validator=validators.ge(0.0))
    """Clip the global gradient norm to this before every optimiser step; 0 disables."""
    micro_batch_tokens: int = attrs.field(default=8192, validator=validators.gt(0))
    """Token budget of one micro-batch (token-balanced packing)."""
    mini_batches: int = attrs.field(default=1, validator=validators.ge(1))
    """Optimiser steps per training step (PPO mini-batches)."""
    bf16: bool | Literal["auto"] = "auto"
    """Mixed precision: compute in bfloat16, parameters and optimiser state stay in
    `model.dtype`. `auto`: bfloat16 on an accelerator that supports it (CUDA: Ampere or
    newer), float32 on the CPU (`peerflow.distributed.devices.resolve_bf16`)."""
    padding_free: bool | Literal["auto"] = "auto"
    """Padding-free micro-batches (a micro-batch's samples in one row, no padding; planned
    by real tokens): `auto` turns them on where attention follows the samples
    (flash-attention's varlen kernels, flex attention), `true` also under sdpa/eager
    (exact, but a dense T x T mask), `false` pads; the rank log says which. `true` needs
    an engine that declares `Capabilities.padding_free` (fsdp, deepspeed; megatron pads)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward: less activation
    memory for about 30 % more compute (needs `Capabilities.activation_checkpointing`:
    fsdp, deepspeed)."""
    routing_replay: Literal["off", "r2", "r3"] | Literal[False] = "off"
    """Mixture-of-experts routing replay (docs/moe.md): `r3` forces the trainer's forwards
    onto the experts the rollout engine chose (the batch's `routed_experts`; needs a rollout
    engine with `Capabilities.routed_experts`), `r2` onto the trainer's own routes from
    its old-log-prob pass, `off` routes natively. Gate weights always come from the live
    router. A dense model refuses `r2`/`r3`. (YAML reads a bare `off` as `false`: both
    mean off.)"""
    router_aux_loss_coef: float = attrs.field(default=0.0, validator=validators.ge(0.0))
    """Weight of the MoE load-balancing (Switch) loss added to the policy loss; 0 logs it
    (`moe/aux_loss`) without training on it."""
    total_steps: int = attrs.field(default=0, validator=validators.ge(0),
                                   metadata={DERIVED: "run.steps x trainer.mini_batches"})
    """Optimiser steps of the whole run, filled in by the runtime from `run.steps` x
    `mini_batches` (`linear` and `cosine` decay over them; 0: unknown, allowed with
    `constant` only). Not a config key."""

    def __attrs_post_init__(self) -> None:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(f"trainer.warmup_steps={self.warmup_steps} and trainer.warmup_ratio="
                             f"{self.warmup_ratio}: set one of them, not both.")

    def for_run(self, steps: int) -> OptimSettings:
        """Returns the engine-facing settings of a run of `steps` training steps.

        Only `OptimSettings` fields are kept (a `TrainerConfig` drops its own), with
        `total_steps` = `steps` x `mini_batches` and the warm-up resolved to steps.

        Args:
            steps: The run's training steps (`run.steps`); 0: unknown (constant only).
        """
        total = steps * self.mini_batches
        values = {f.name: getattr(self, f.name) for f in attrs.fields(OptimSettings)}
        warmup = self.warmup_steps or round(self.warmup_ratio * total)
        return OptimSettings(**{**values, "total_steps": total, "warmup_steps": warmup,
                                "warmup_ratio": 0.0})
