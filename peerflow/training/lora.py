"""LoRA through peft, written once for every engine that declares `Capabilities.lora`.

* `apply_lora(model, lora)` wraps a transformers causal LM with peft's LoRA
  (`trainer.lora`): base weights frozen, adapters trainable. Train engines call it before
  they shard the model (FSDP2, DeepSpeed), rollout engines to apply synced adapters.
* `adapter_parameters(model)` lists the adapter tensors under **peft's file names**
  (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, what
  `adapter_model.safetensors` holds): the canonical names of an adapter-only weight sync,
  checkpoint and export, as HF names are for full weights.
* `BaseModelView` is the reference role of a LoRA run: the actor engine with its
  adapters switched off (peft's `disable_adapter()`), no second copy of the weights.
* `rollout_model(model, lora)` is a rollout engine's model and the tensors a sync writes.
* `adapter_layout(path, lora)` gives the adapter names and shapes without loading weights.
* `base_fingerprint(path)` identifies the base weights an adapter checkpoint belongs to.

`peerflow config validate` refuses a `trainer.lora` run whose train or rollout backend
does not declare `Capabilities.lora` (`peerflow.config.refusals`), or where peft is not
installed (`peerflow.config.extras`).

peft is imported inside the functions: `import peerflow` does not import it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from peerflow.errors import ConfigError

#: peft's adapter name inside the live module; peft's files drop it from tensor names.
ADAPTER = "default"
_ADAPTER_PARAM = re.compile(r"\.(lora_(?:embedding_)?[AB])\." + ADAPTER + r"(?=\.|$)")


def apply_lora(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """Wraps `model` with peft's LoRA of `lora` (a `peerflow.engines.lora.LoraConfig`).

    The base weights are frozen (`requires_grad=False`); the adapters are trainable and
    start as peft initialises them (`A` random, `B` zero: the adapted model equals the
    base). Raises a `ConfigError` naming `trainer.lora.target_modules` when no module
    matches.
    """
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora.to_peft())
    except ValueError as exc:
        if "target modules" not in str(exc).lower():
            raise
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"trainer.lora.target_modules={lora.target_modules!r} matches no module of "
            f"{type(model).__name__}; its linear layers are {names} (or use 'all-linear')."
        ) from exc


def rollout_model(model: torch.nn.Module, lora: Any
                  ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A rollout engine's model and the tensors a weight sync writes into.

    Without `lora`: `model` and every parameter (HF names). With it: the peft model and its
    adapter tensors only (peft's file names); the base weights never move.
    """
    if lora is None:
        return model, dict(model.named_parameters())
    model = apply_lora(model, lora)
    return model, dict(adapter_parameters(model))


def is_adapter(name: str) -> bool:
    """Whether a live parameter name is a LoRA adapter tensor."""
    return _ADAPTER_PARAM.search(name) is not None


def adapter_name(name: str) -> str:
    """The peft file name of a live adapter parameter (its adapter name dropped)."""
    return _ADAPTER_PARAM.sub(r".\1", name)


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`(peft file name, live parameter)` of every adapter tensor of `model`, in order."""
    return [(adapter_name(n), p) for n, p in model.named_parameters() if is_adapter(n)]


def adapter_layout(model_path: str | Path, lora: Any) -> tuple[dict[str, tuple[int, ...]], Any]:
    """The adapter tensors peft puts on the model at `model_path`, without its weights.

    Built on the meta device from the model's config, for engines that hold adapters
    outside a peft model (vLLM's LoRA).

    Returns:
        `(shapes, peft_config)`: every adapter tensor's shape under peft's file names, and
        the resolved `peft.LoraConfig` (`all-linear` replaced by the module names), the
        `adapter_config.json` of an adapter directory.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = apply_lora(AutoModelForCausalLM.from_config(config), lora)
    shapes = {name: tuple(p.shape) for name, p in adapter_parameters(model)}
    return shapes, model.peft_config[ADAPTER]


def peft_module(model: Any) -> Any:
    """The peft model inside `model` (itself, or a framework wrapper's `.module`)."""
    for candidate in (model, getattr(model, "module", None)):
        if candidate is not None and hasattr(candidate, "disable_adapter"):
            return candidate
    raise RuntimeError(
        f"{type(model).__name__} carries no LoRA adapters; the engine was built without "
        "trainer.lora."
    )


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """Runs the body on the base model: every adapter of `model` switched off."""
    with peft_module(model).disable_adapter():
        yield


class BaseModelView:
    """The reference role of a LoRA run: the actor engine with its adapters off.

    Its `forward_logprobs` is the actor's under `adapters_disabled`; every other attribute
    is the actor's (one model, one copy of the base weights). The KL term then compares
    the adapted policy with its own base, as a separate frozen reference engine would.
    """

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def forward_logprobs(self, batch: Any) -> Any:
        """The base model's log-probs of `batch` (collective like the actor's)."""
        with adapters_disabled(self._model()):
            return self.actor.forward_logprobs(batch)

    def _model(self) -> Any:
        """The actor's module: `model` (fsdp), or its framework engine.

        DeepSpeed's `engine`, whose `.module` is the peft model.
        """
        for attribute in ("model", "engine"):
            found = getattr(self.actor, attribute, None)
            if found is not None:
                return found
        raise RuntimeError(f"{type(self.actor).__name__} exposes no `model` or `engine`; the "
                           "LoRA reference cannot switch its adapters off.")

    def shutdown(self) -> None:
        """Nothing of its own to release: the actor owns the model."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actor, name)


def base_fingerprint(path: str | Path) -> str:
    """A SHA-256 identifying the base weights at `path` (a Hugging Face directory).

    `peerflow.digests.sampled_sha256` of every weight file: names, sizes and three 1 MiB
    samples each, so another model of the same architecture (a fine-tuned one) differs,
    without reading a 7B model's 14 GB.
    """
    from peerflow.digests import sampled_sha256

    return sampled_sha256(sorted(p for p in Path(path).iterdir()
                                 if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()))


def check_base(saved: str | None, path: str | Path, where: str) -> None:
    """Refuses to load adapters saved on another base model than the one at `path`.

    Raises:
        ConfigError: `saved` (the checkpoint's `base_fingerprint`) differs.
    """
    if saved is None:
        return
    current = base_fingerprint(path)
    if saved != current:
        raise ConfigError(
            f"{where} holds LoRA adapters trained on another base model (fingerprint "
            f"{saved[:12]}…, the model at {path} is {current[:12]}…); resume with the "
            "model.path (or builder) the run started from."
        )
