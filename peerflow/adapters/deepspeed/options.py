"""Options of the `deepspeed` train engine (`trainer.deepspeed: {...}` in a run config)."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import attrs

from peerflow.engines import OptimSettings
from peerflow.errors import ConfigError

#: Keys PeerFlow fills from `OptimSettings` and the batch planner; a pass-through `config`
#: that sets them is rejected so one setting cannot silently override the other.
MANAGED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer",
)


def _check_stage(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value not in (0, 1, 2, 3):
        raise ConfigError(
            f"trainer.deepspeed.zero_stage={value!r}: expected 0, 1, 2 or 3 "
            "(0 = plain data parallel, 3 = parameters partitioned too)."
        )


def _check_config(instance: object, attribute: attrs.Attribute, value: dict) -> None:
    if not isinstance(value, dict):
        raise ConfigError(
            f"trainer.deepspeed.config must be a mapping of DeepSpeed config keys, got "
            f"{type(value).__name__}."
        )
    clash = sorted(set(value) & set(MANAGED_KEYS))
    if clash:
        raise ConfigError(
            f"trainer.deepspeed.config sets {clash}, which PeerFlow derives from the trainer "
            "section (lr, betas, grad_clip, micro_batch_tokens); set those there instead."
        )
    zero = value.get("zero_optimization", {})
    if isinstance(zero, dict) and "stage" in zero:
        raise ConfigError(
            "trainer.deepspeed.config.zero_optimization.stage is set; use "
            "trainer.deepspeed.zero_stage instead."
        )


@attrs.frozen(kw_only=True)
class DeepSpeedOptions:
    """How the DeepSpeed engine partitions and runs the model.

    Anything not modelled here goes through `config`, which is merged into the generated
    DeepSpeed config and validated by DeepSpeed itself (e.g. `zero_optimization.
    offload_optimizer`, `zero_optimization.reduce_bucket_size`, `bf16`, `comms_logger`).
    """

    renamed_keys: ClassVar[dict[str, str]] = {
        "gradient_checkpointing": "set trainer.activation_checkpointing: true instead (one "
                                  "knob for every train backend)."}
    """Keys this section once had, and what replaced them (said by `config validate`)."""

    zero_stage: int = attrs.field(default=2, validator=_check_stage)
    """ZeRO stage: 1 partitions optimiser state, 2 also gradients, 3 also parameters."""
    config: dict[str, Any] = attrs.field(factory=dict, validator=_check_config)
    """Native DeepSpeed config keys merged over the generated config (pass-through)."""
    share_prompts: bool = True
    """Run a prompt once for all its samples in a micro-batch, as `trainer.fsdp.share_prompts`
    does (docs/training.md, "Shared prompts"); off under an attention backend that takes no
    custom 4D mask."""
    checkpoint_tag: str = "peerflow"
    """Tag DeepSpeed's checkpoint files are saved under inside the checkpoint directory."""

    def deepspeed_config(self, optim: OptimSettings, *, bf16: bool) -> dict[str, Any]:
        """Returns the DeepSpeed config dict for these options and optimiser settings.

        PeerFlow runs gradient accumulation itself (token-budget micro-batches, boundary
        set per micro-batch), so DeepSpeed sees one micro-batch per step.
        """
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(optim.grad_clip),
            "zero_optimization": {"stage": self.zero_stage},
            "bf16": {"enabled": bool(bf16)},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
            "zero_allow_untested_optimizer": True,
        }
        for key, value in copy.deepcopy(self.config).items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        return config
