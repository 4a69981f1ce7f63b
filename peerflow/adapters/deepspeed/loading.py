"""Filling a (ZeRO-3-partitioned) HF model from its checkpoint, and send ownership.

The model is filled without building it whole on any rank: one parameter is gathered at a
time and rank 0 copies the checkpoint tensor into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerflow.models.packed_experts import canonical_expert_spec
from peerflow.models.safetensors_reader import SafetensorsReader
from peerflow.shard import ShardSpec


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
        spec = None if name in reader else _canonical(model, name, param)
        if name not in reader and not _has_experts(reader, spec):
            if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            raise KeyError(
                f"parameter {name!r} of {type(model).__name__} is not in the checkpoint at "
                f"{model_path}; the checkpoint and config disagree."
            )
        if partitioned:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank0:
                    param.data.copy_(_read(reader, name, spec, param.ds_shape))
        else:
            with torch.no_grad():
                param.copy_(_read(reader, name, spec, param.shape))


def _canonical(model: torch.nn.Module, name: str, param: torch.Tensor) -> ShardSpec | None:
    """The checkpoint tensors a module parameter is cut from, when its name is not one.

    Packed experts (`mlp.experts.gate_up_proj` `[E, 2I, H]`: gate then up rows per
    expert; `down_proj` `[E, H, I]`) are the experts' checkpoint tensors one by one, and
    Mixtral's `mlp.gate` is the checkpoint's `block_sparse_moe.gate`
    (`peerflow.models.packed_experts`); `None` for any other parameter.
    """
    shape = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3: the full shape
    return canonical_expert_spec(model.config, ShardSpec.of_slice(name, shape))


def _has_experts(reader: SafetensorsReader, spec: ShardSpec | None) -> bool:
    """Whether the checkpoint holds every tensor `spec` is cut from."""
    return spec is not None and all(p.name in reader for p in spec.pieces)


def _read(reader: SafetensorsReader, name: str, spec: ShardSpec | None,
          shape: Sequence[int]) -> torch.Tensor:
    """The checkpoint tensor `name`, or the tensor of `shape` cut from `spec`'s pieces."""
    if name in reader:
        return reader.get(name)
    assert spec is not None, name
    out = None
    for piece in spec.pieces:
        tensor = reader.get(piece.name)
        if out is None:
            out = torch.empty(spec.local_shape, dtype=tensor.dtype)
        out[piece.local_box.slices()] = tensor[piece.global_box.slices()]
    return out.view(tuple(shape))


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
