"""Config sections that select and shape engines: `rollout`, `trainer`, `weight_sync`."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from peerflow.config.lora import LoraConfig
from peerflow.config.structure import SECTIONS
from peerflow.engines import OptimSettings, SamplingParams
from peerflow.layout import ParallelLayout


@attrs.frozen(kw_only=True)
class LayoutConfig:
    """Parallel degrees of one role (its ranks are placed by the planner)."""

    dp: int = 1
    """Data-parallel degree; 0 means "all ranks left after tp/pp", decided at launch."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree."""

    def to_layout(self, world_size: int, ranks: tuple[int, ...] = ()) -> ParallelLayout:
        """Returns the `ParallelLayout` on `world_size` ranks (resolving `dp: 0`)."""
        model = self.tp * self.pp * self.ep
        dp = self.dp or max(1, world_size // model)
        return ParallelLayout(dp=dp, tp=self.tp, pp=self.pp, ep=self.ep, ranks=ranks)


def _section_field() -> Any:
    return attrs.field(factory=dict, metadata={SECTIONS: True})


@attrs.frozen(kw_only=True)
class SamplingConfig:
    """Sampling settings of the `generate` node (see `peerflow.SamplingParams`)."""

    n: int = 8
    """Answers per prompt (the group size)."""
    temperature: float = attrs.field(default=1.0)
    """Softmax temperature (> 0). Train engines and the reference model compute log-probs
    at this temperature too, so the policy they train is the one that sampled."""

    @temperature.validator
    def _check_temperature(self, _: attrs.Attribute, value: float) -> None:
        if not value > 0:
            raise ValueError(
                f"rollout.sampling.temperature={value}: a training run needs a positive "
                "temperature (greedy decoding, 0, gives every answer of a group the same "
                "tokens and has no log-probs to train on); use e.g. 1.0."
            )
    top_p: float = 1.0
    """Nucleus mass; 1.0 disables."""
    top_k: int = 0
    """Top-k cut-off; 0 disables."""
    max_tokens: int = 16
    """Most tokens generated per answer."""
    stop: list[str] = attrs.field(factory=list)
    """Stop strings."""

    def to_params(self, seed: int | None = None) -> SamplingParams:
        """Returns the engine-facing `SamplingParams`."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens, stop=tuple(self.stop), seed=seed,
        )


def _positive(_: Any, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"rollout.agent.{attribute.name}={value}: must be positive.")


@attrs.frozen(kw_only=True)
class AgentConfig:
    """Multi-turn agent rollouts (`peerflow.agents`).

    Present, every trajectory is an episode of `environment`, driven turn by turn by
    `peerflow.agents.rollout`.
    """

    environment: str
    """Registered environment (`peerflow_register_environments`) each trajectory runs in."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """The environment's options (its `options_class`), validated before workers start."""
    max_turns: int = attrs.field(default=4, validator=_positive)
    """Most model turns per trajectory; an episode still open after them ends with
    `finish_reason` `max_turns`."""
    max_total_tokens: int = attrs.field(default=1024, validator=_positive)
    """Most tokens after the first prompt (model turns and observations together); a
    trajectory that reaches it ends with `finish_reason` `max_tokens`."""
    max_turn_tokens: int = 0
    """Most tokens the model samples in one turn (0: `rollout.sampling.max_tokens`)."""
    max_observation_tokens: int = attrs.field(default=256, validator=_positive)
    """Most tokens of one observation; longer ones are cut (their end dropped)."""
    step_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    """Seconds one `Environment.step` may run; past it the trajectory ends with
    `finish_reason` `env_timeout` (the others go on)."""
    concurrency: int = attrs.field(default=16, validator=_positive)
    """Most `Environment.step` calls running at once (threads)."""
    on_env_error: Literal["drop_group", "mask", "train"] = "drop_group"
    """What training does with a trajectory the environment failed (`finish_reason`
    `env_error` or `env_timeout`: not the model's doing). `drop_group`: leave its whole
    GRPO group out (their baseline is corrupted); `mask`: leave the trajectory alone out,
    its group's baseline computed over the others; `train`: train on it like any other
    (see `peerflow.algorithms.failed_samples`)."""


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """The inference engine. `rollout.<backend>: {...}` holds that adapter's options."""

    backend: str = "hf"
    """Registered rollout backend: hf, vllm, sglang, or a plugin's name."""
    sampling: SamplingConfig = attrs.Factory(SamplingConfig)
    """How answers are sampled."""
    layout: LayoutConfig = attrs.Factory(LayoutConfig)
    """Parallel layout of the rollout role."""
    agent: AgentConfig | None = None
    """Multi-turn agent rollouts; absent (the default) means single-turn answers."""
    engine_options: dict[str, dict[str, Any]] = _section_field()
    """Per-backend option sections, keyed by backend name (validated when selected)."""


@attrs.frozen(kw_only=True)
class TrainerConfig:
    """The training engine. `trainer.<backend>: {...}` holds that adapter's options."""

    backend: str = "fsdp"
    """Registered trainer backend: fsdp, deepspeed, megatron, or a plugin's name."""
    lr: float = attrs.field(default=1e-6, validator=attrs.validators.gt(0.0))
    """Peak AdamW learning rate. 1e-6 (TRL's and verl's RL default) is safe for a
    pretrained model; tiny models trained from scratch need far more (the examples set
    1e-3)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up, over optimiser steps (`run.steps` x
    `mini_batches`): `constant`, or `linear` / `cosine` decay to `min_lr_ratio` x `lr`
    at the run's last step (docs/training.md)."""
    warmup_steps: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Optimiser steps of linear warm-up to `lr` (0: none)."""
    warmup_ratio: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0),
                                                              attrs.validators.lt(1.0)])
    """Warm-up as a share of the run's optimiser steps, instead of `warmup_steps`."""
    min_lr_ratio: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0),
                                                              attrs.validators.le(1.0)])
    """Floor of `linear` and `cosine`, a fraction of `lr` (their warm-up starts there)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = attrs.field(default=1.0, validator=attrs.validators.ge(0.0))
    """Clip the global gradient norm to this before every optimiser step; 0 disables."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch (token-balanced packing)."""
    mini_batches: int = 1
    """Optimiser steps per training step (PPO mini-batches)."""
    bf16: bool | Literal["auto"] = "auto"
    """Mixed precision: compute in bfloat16, parameters and optimiser state stay in
    `model.dtype`. `auto`: bfloat16 on an accelerator that supports it (CUDA: Ampere or
    newer), float32 on the CPU (`peerflow.distributed.devices.resolve_bf16`)."""
    padding_free: bool | Literal["auto"] = "auto"
    """Padding-free micro-batches (a micro-batch's samples in one row, no padding; planned
    by real tokens): `auto` turns them on where attention follows the samples
    (flash-attention's varlen kernels, flex attention), `true` also under sdpa/eager
    (exact, but a dense T x T mask), `false` pads; the rank log says which. fsdp and
    deepspeed; megatron pads (docs/training.md)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward: less activation
    memory for about 30 % more compute (fsdp, deepspeed)."""
    layout: LayoutConfig = attrs.Factory(LayoutConfig)
    """Parallel layout of the trainer role."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`trainer.lora: {rank: 16}`); absent
    (the default) trains the full model. See docs/lora.md."""
    engine_options: dict[str, dict[str, Any]] = _section_field()
    """Per-backend option sections, keyed by backend name (validated when selected)."""

    def __attrs_post_init__(self) -> None:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(f"trainer.warmup_steps={self.warmup_steps} and trainer.warmup_ratio="
                             f"{self.warmup_ratio}: set one of them, not both.")

    def optim_settings(self, steps: int = 0) -> OptimSettings:
        """Returns the engine-facing optimiser settings.

        Args:
            steps: The run's training steps (`run.steps`); the schedule counts
                `steps * mini_batches` optimiser steps. 0: unknown (constant only).
        """
        total = steps * self.mini_batches
        warmup = self.warmup_steps or round(self.warmup_ratio * total)
        return OptimSettings(
            lr=self.lr, betas=self.betas, weight_decay=self.weight_decay,
            grad_clip=self.grad_clip, micro_batch_tokens=self.micro_batch_tokens,
            mini_batches=self.mini_batches, bf16=self.bf16, lr_schedule=self.lr_schedule,
            warmup_steps=warmup, total_steps=total, min_lr_ratio=self.min_lr_ratio,
            padding_free=self.padding_free,
            activation_checkpointing=self.activation_checkpointing,
        )


@attrs.frozen(kw_only=True)
class WeightSyncConfig:
    """How new trainer weights reach the rollout engine."""

    transport: str = "auto"
    """Registered weight transport; `auto` picks one from the placement and devices."""
    bucket_bytes: int = 256 * 2**20
    """Most bytes packed into one bucket (bounds extra memory per rank)."""
    every: int = 1
    """Sync after every this many optimiser steps."""
    mode: Literal["bucketed"] = "bucketed"
    """Sync strategy."""
