"""Reading a Hugging Face safetensors checkpoint tensor by tensor (or slice by slice).

Train adapters fill their own layouts from it without loading the whole model on a rank.
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
