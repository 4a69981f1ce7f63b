"""Exporting a `trainer.lora` run: the adapter in peft's format, or the merged model.

A LoRA run's checkpoints hold the adapters only (peft's tensor names). `--lora adapter`
(the default) writes them as a peft adapter directory — `adapter_model.safetensors`,
`adapter_config.json` (target modules resolved, `base_model_name_or_path` the run's
model directory) and the tokenizer — which `PeftModel.from_pretrained(base, OUT_DIR)`
and `vllm serve BASE --enable-lora --lora-modules name=OUT_DIR` load. `--lora merged`
loads the base model, sets the adapters through peft and merges them
(`merge_and_unload`: `W + (alpha / rank) B @ A`), and writes a plain Hugging Face model
directory with `write_model_dir`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from peerflow.errors import ConfigError

#: `--lora` choices.
LORA_MODES = ("adapter", "merged")


def write_lora(out_dir: Path, adapters: Mapping[str, torch.Tensor], *, lora: Any,
               model_path: str, mode: str, files: Mapping[str, Any],
               max_shard_size: int | str) -> dict[str, torch.Tensor]:
    """Writes the adapter (`adapter`) or the merged model (`merged`) into `out_dir`.

    Args:
        out_dir: The directory to write (created).
        adapters: The checkpoint's adapter tensors, whole, under peft's names.
        lora: The run's `trainer.lora`.
        model_path: The base model directory the run trained from.
        mode: `adapter` or `merged`.
        files: The base model's `config`, `generation_config` and `tokenizer`.
        max_shard_size: Largest safetensors file of a merged model.

    Returns:
        The tensors written.

    Raises:
        ConfigError: an unknown mode, or tensors that are not this model's adapters.
    """
    from safetensors.torch import save_file

    from peerflow.hf_export.hf_dir import unique_tensors, write_model_dir
    from peerflow.training.lora import adapter_layout, apply_lora

    if mode not in LORA_MODES:
        raise ConfigError(f"--lora {mode!r}: use one of {', '.join(LORA_MODES)}.")
    shapes, peft_config = adapter_layout(model_path, lora)
    got = {n: tuple(t.shape) for n, t in adapters.items()}
    if got != shapes:
        wrong = sorted(set(got.items()) ^ set(shapes.items()))[:3]
        raise ConfigError(f"the checkpoint's adapters do not fit trainer.lora on {model_path} "
                          f"(first differences: {wrong}); export with the run's config.")
    if mode == "merged":
        from peft import set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        dtype = next(iter(adapters.values())).dtype
        model = apply_lora(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype), lora)
        set_peft_model_state_dict(model, dict(adapters))
        merged = unique_tensors(model.merge_and_unload())
        write_model_dir(out_dir, merged, max_shard_size=max_shard_size, **files)
        return merged
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in adapters.items()},
              str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config.base_model_name_or_path = str(Path(model_path).resolve())
    peft_config.save_pretrained(str(out_dir))
    if files.get("tokenizer") is not None:
        files["tokenizer"].save_pretrained(out_dir)
    return dict(adapters)
