"""Moving weights between Hugging Face checkpoints and Megatron's sharded layout.

Both directions are driven by the same `ShardSpec`s (`peerflow.models.megatron_layout`):
a spec says which HF regions sit where in one Megatron rank's tensor, so importing reads
only those regions from the safetensors files (never a full tensor a rank does not hold),
and exporting hands the local tensors to the resharder as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerflow.errors import ShardError
from peerflow.models.safetensors_reader import SafetensorsReader
from peerflow.shard import ShardSpec


def import_hf_weights(params: dict[str, torch.nn.Parameter], specs: Sequence[ShardSpec],
                      reader: SafetensorsReader) -> None:
    """Fills every Megatron parameter named in `specs` from the HF checkpoint.

    Padding regions (vocab rows past the real vocabulary) are zeroed.

    Raises:
        ShardError: A spec names a parameter the model lacks, or shapes disagree (the
            model was built for another config or layout).
    """
    for spec in specs:
        param = params.get(spec.local_name)
        if param is None:
            raise ShardError(
                f"Megatron layout names {spec.local_name!r} but the built GPTModel has no such "
                f"parameter (it has e.g. {sorted(params)[:4]}); the layer spec and the layout "
                "naming disagree."
            )
        if tuple(param.shape) != spec.local_shape:
            raise ShardError(
                f"{spec.local_name}: GPTModel shape {tuple(param.shape)} != layout shape "
                f"{spec.local_shape}; check tp size and vocab padding."
            )
        with torch.no_grad():
            for box in spec.padding:
                param[box.slices()] = 0
            for piece in spec.pieces:
                region = reader.get(piece.name, piece.global_box.slices())
                param[piece.local_box.slices()] = region.to(param.dtype)


def covered_names(specs: Sequence[ShardSpec]) -> set[str]:
    """Local parameter names the specs describe."""
    return {s.local_name for s in specs}
