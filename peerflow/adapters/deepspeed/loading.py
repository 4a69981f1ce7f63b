"""Reading Hugging Face safetensors checkpoints tensor by tensor, and send ownership.

Used by the DeepSpeed adapter to fill a ZeRO-3-partitioned model without building the
whole model on any rank (one parameter is gathered at a time), and by the Megatron
adapter to read HF tensors it slices into its own layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

import torch


class SafetensorsReader:
    """Lazy access to the tensors of a HF model directory (single or sharded safetensors)."""

    def __init__(self, model_path: str) -> None:
        index = os.path.join(model_path, "model.safetensors.index.json")
        single = os.path.join(model_path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
            self._files = {name: os.path.join(model_path, f) for name, f in weight_map.items()}
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as handle:
                self._files = {name: single for name in handle.keys()}
        else:
            raise FileNotFoundError(
                f"{model_path} has no model.safetensors or model.safetensors.index.json; "
                "save the model with save_pretrained(safe_serialization=True)."
            )

    def names(self) -> list[str]:
        """HF tensor names in the checkpoint."""
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, box: Sequence[slice] | None = None) -> torch.Tensor:
        """Reads one tensor, or only the `box` slices of it (without reading the rest)."""
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as handle:
            if box is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[tuple(box)]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields every `(name, tensor)`."""
        for name in self._files:
            yield name, self.get(name)


def load_hf_weights(model: torch.nn.Module, model_path: str, *, partitioned: bool) -> None:
    """Copies checkpoint tensors into `model`'s parameters and buffers by HF name.

    Args:
        model: A HF model built with `from_config` (under `deepspeed.zero.Init` when
            `partitioned`).
        model_path: The HF model directory.
        partitioned: Gather each ZeRO-3 parameter alone (`GatheredParameters`, modifier
            rank 0), so at most one full tensor exists at a time.

    Raises:
        KeyError: A parameter is missing from the checkpoint and is not tied to one that
            is present (names the parameter).
    """
    reader = SafetensorsReader(model_path)
    rank0 = True
    if partitioned:
        import deepspeed
        import torch.distributed as dist

        rank0 = dist.get_rank() == 0
    for name, param in model.named_parameters():
        if name not in reader:
            if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            raise KeyError(
                f"parameter {name!r} of {type(model).__name__} is not in the checkpoint at "
                f"{model_path}; the checkpoint and config disagree."
            )
        if partitioned:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank0:
                    param.data.copy_(reader.get(name))
        else:
            with torch.no_grad():
                param.copy_(reader.get(name))


def owners_by_size(shapes: Sequence[tuple[str, tuple[int, ...]]], ranks: int) -> dict[str, int]:
    """Assigns every tensor to the least-loaded rank (largest first), deterministically.

    Each rank then sends about `1/ranks` of the bytes during a weight sync instead of one
    rank sending everything.
    """
    load = [0] * ranks
    owners: dict[str, int] = {}
    ordered = sorted(shapes, key=lambda item: (-int(torch.Size(item[1]).numel()), item[0]))
    for name, shape in ordered:
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += int(torch.Size(shape).numel())
    return owners
