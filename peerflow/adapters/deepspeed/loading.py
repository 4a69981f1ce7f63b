"""Filling a (ZeRO-3-partitioned) HF model from its checkpoint, and send ownership.

The model is filled without building it whole on any rank: one parameter is gathered at a
time and rank 0 copies the checkpoint tensor into it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from peerflow.models.safetensors_reader import SafetensorsReader


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
        if name not in reader and not _has_experts(reader, name):
            if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            raise KeyError(
                f"parameter {name!r} of {type(model).__name__} is not in the checkpoint at "
                f"{model_path}; the checkpoint and config disagree."
            )
        if partitioned:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank0:
                    param.data.copy_(_read(reader, name))
        else:
            with torch.no_grad():
                param.copy_(_read(reader, name))


_PACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _has_experts(reader: SafetensorsReader, name: str) -> bool:
    """Whether `name` is a packed expert tensor whose experts the checkpoint holds."""
    match = _PACKED.match(name)
    return match is not None and f"{match.group(1)}.0.down_proj.weight" in reader


def _read(reader: SafetensorsReader, name: str) -> torch.Tensor:
    """The checkpoint tensor `name`.

    A transformers packed expert tensor is assembled from the checkpoint's experts, one by
    one (`gate_up_proj` `[E, 2I, H]`: gate then up rows per expert; `down_proj` `[E, H, I]`).
    """
    if name in reader:
        return reader.get(name)
    match = _PACKED.match(name)
    assert match is not None, name
    prefix, experts = match.group(1), []
    while f"{prefix}.{len(experts)}.down_proj.weight" in reader:
        x = f"{prefix}.{len(experts)}."
        experts.append(torch.cat([reader.get(f"{x}gate_proj.weight"),
                                  reader.get(f"{x}up_proj.weight")])
                       if match.group(2) == "gate_up_proj" else reader.get(f"{x}down_proj.weight"))
    return torch.stack(experts)


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
