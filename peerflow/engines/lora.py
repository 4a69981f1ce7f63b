"""`trainer.lora`: train low-rank adapters instead of every weight (LoRA, through peft)."""

from __future__ import annotations

from typing import Any

import attrs


def _dropout(_: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"trainer.lora.dropout={value!r}: must be in [0, 1).")


def _targets(_: Any, attribute: attrs.Attribute, value: str | list[str]) -> None:
    if isinstance(value, str) and value != "all-linear":
        raise ValueError(
            f"trainer.lora.target_modules={value!r}: give a list of module names "
            "(e.g. [q_proj, v_proj]) or the string 'all-linear'."
        )
    if isinstance(value, list) and not value:
        raise ValueError("trainer.lora.target_modules is empty; name at least one module "
                         "(e.g. [q_proj, v_proj]) or use 'all-linear'.")


@attrs.frozen(kw_only=True)
class LoraConfig:
    """Low-rank adapters on the policy (`trainer.lora: {...}`; absent: full fine-tuning).

    The train engine wraps the model with peft's LoRA and trains the adapters only (the
    optimiser holds their state only); the reference policy for KL is the same model with
    its adapters switched off; weight syncs move the adapter tensors only to a rollout
    engine that declares `Capabilities.lora`; checkpoints hold the adapters and their
    optimiser state, with the base model fingerprinted (docs/lora.md).
    """

    rank: int = attrs.field(
        default=16, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    """Adapter rank `r`: `A` is `[r, in]`, `B` is `[out, r]`."""
    alpha: float = 32.0
    """Scale numerator: the update added to a weight is `(alpha / rank) * B @ A`."""
    dropout: float = attrs.field(default=0.0, validator=_dropout)
    """Dropout on the adapter's input while training (0 keeps trainer and rollout
    log-probs equal; the rollout engines never apply it)."""
    target_modules: str | list[str] = attrs.field(default="all-linear", validator=_targets)
    """Modules that get adapters: names matched as peft does (`[q_proj, v_proj]`), or
    `all-linear` (every linear layer but the output layer)."""

    @property
    def scaling(self) -> float:
        """`alpha / rank`, the factor peft applies to `B @ A`."""
        return self.alpha / self.rank

    def to_peft(self) -> Any:
        """The `peft.LoraConfig` of these settings (imports peft)."""
        from peft import LoraConfig as PeftLoraConfig

        targets = self.target_modules
        return PeftLoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
            target_modules=targets if isinstance(targets, str) else list(targets),
            bias="none", task_type="CAUSAL_LM",
        )
