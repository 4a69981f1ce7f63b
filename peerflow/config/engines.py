"""Config sections that select and shape engines: `rollout`, `trainer`, `weight_sync`."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from peerflow.config.structure import SECTIONS
from peerflow.engines import OptimSettings, SamplingParams
from peerflow.engines.lora import LoraConfig


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
    max_turns: int = attrs.field(default=4, validator=attrs.validators.gt(0))
    """Most model turns per trajectory; an episode still open after them ends with
    `finish_reason` `max_turns`."""
    max_total_tokens: int = attrs.field(default=1024, validator=attrs.validators.gt(0))
    """Most tokens after the first prompt (model turns and observations together); a
    trajectory that reaches it ends with `finish_reason` `max_tokens`."""
    max_turn_tokens: int = 0
    """Most tokens the model samples in one turn (0: `rollout.sampling.max_tokens`)."""
    max_observation_tokens: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    """Most tokens of one observation; longer ones are cut (their end dropped)."""
    step_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    """Seconds one `Environment.step` may run; past it the trajectory ends with
    `finish_reason` `env_timeout` (the others go on)."""
    concurrency: int = attrs.field(default=16, validator=attrs.validators.gt(0))
    """Most `Environment.step` calls running at once (threads)."""
    on_env_error: Literal["drop_group", "mask", "train"] = "drop_group"
    """What training does with a trajectory the environment failed (`finish_reason`
    `env_error` or `env_timeout`: not the model's doing). `drop_group`: leave its whole
    GRPO group out (their baseline is corrupted); `mask`: leave the trajectory alone out,
    its group's baseline computed over the others; `train`: train on it like any other
    (see `peerflow.algorithms.failed_samples`)."""
    fatal_after_steps: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    """Stop the run when every episode of this many steps in a row failed (`env_error` or
    `env_timeout`): the error names the first failure of the streak, with its traceback
    (`RUN_DIR/agent_errors.jsonl`). 0: never stop."""


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """The inference engine. `rollout.<backend>: {...}` holds that adapter's options."""

    backend: str = "hf"
    """Registered rollout backend: hf, vllm, sglang, or a plugin's name."""
    sampling: SamplingConfig = attrs.Factory(SamplingConfig)
    """How answers are sampled."""
    layout: LayoutConfig = attrs.Factory(LayoutConfig)
    """Parallel layout of the rollout role."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The rollout engine's parameter dtype; `None` (the default): `model.dtype`, the
    trainer's. `bfloat16` beside a float32 `model.dtype` is verl's and TRL's setup on a
    GPU: the trainer updates float32 weights, the rollout serves them rounded once per
    sync (sent as bfloat16: half the bytes), and the log-prob mismatch that rounding
    adds is logged (`mismatch/*`) and corrected like any other (`algorithm.off_policy`)."""
    agent: AgentConfig | None = None
    """Multi-turn agent rollouts; absent (the default) means single-turn answers."""
    engine_options: dict[str, dict[str, Any]] = _section_field()
    """Per-backend option sections, keyed by backend name (validated when selected)."""


@attrs.frozen(kw_only=True)
class TrainerConfig(OptimSettings):
    """The training engine. `trainer.<backend>: {...}` holds that adapter's options.

    Every optimiser and step setting (`lr`, `micro_batch_tokens`, `bf16`, …) is a field of
    `peerflow.engines.OptimSettings`, written once there with its default; this class adds
    what selects and places the engine.
    """

    backend: str = "fsdp"
    """Registered trainer backend: fsdp, deepspeed, megatron, or a plugin's name."""
    layout: LayoutConfig = attrs.Factory(LayoutConfig)
    """Parallel layout of the trainer role."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`trainer.lora: {rank: 16}`); absent
    (the default) trains the full model. See docs/lora.md."""
    engine_options: dict[str, dict[str, Any]] = _section_field()
    """Per-backend option sections, keyed by backend name (validated when selected)."""

    def optim_settings(self, steps: int = 0) -> OptimSettings:
        """Returns the engine-facing settings of a run of `steps` steps (`OptimSettings.for_run`).

        Args:
            steps: The run's training steps (`run.steps`); the schedule counts
                `steps * mini_batches` optimiser steps. 0: unknown (constant only).
        """
        return self.for_run(steps)


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
    encoding: Literal["auto", "full", "delta"] = "auto"
    """`full`: every packed byte travels; `delta`: routes between ranks carry only the
    words that changed since the receiver's copy, checked by checksums
    (`peerflow.reshard.delta`); `auto`: `delta` on routes whose ranks are on different
    hosts (the slow links), `full` on one host (shared memory, NVLink, CUDA IPC)."""
    full_every: int = attrs.field(default=32, validator=attrs.validators.ge(0))
    """With delta routes: a route travels whole every this many syncs (a periodic anchor;
    0: only when a receiver's copy does not match the sender's)."""
