"""Whole Hugging Face tensors from the shards of a train engine's checkpoint.

Every train adapter describes its checkpoint as `SavedShard`s (`TrainEngine.saved_shards`):
local tensors as pieces of HF tensors, the canonical wire format of the weight sync. The
regions are planned with the weight sync's own planner (`peerflow.reshard.plan_reshard`,
one destination: every HF tensor whole), so a gap, an overlap or a shape disagreement is
refused naming the tensor and the region, and each element is copied from exactly one
saved region (replica 0 first). Shards are read one at a time; the result is one full
host copy of the model (a whole saved tensor of the requested dtype is used as it is).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerflow.engines.train import SavedShard
from peerflow.errors import ShardError
from peerflow.reshard.plan import Transfer, plan_reshard
from peerflow.shard import ShardSpec


def _whole(transfer: Transfer, shape: tuple[int, ...], tensor: torch.Tensor) -> bool:
    return transfer.dst_box.sizes == shape and tuple(tensor.shape) == shape


def assemble_hf_tensors(shards: Sequence[SavedShard], *,
                        dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Returns every HF tensor the shards hold, whole, on the host.

    Args:
        shards: A checkpoint's shards (`TrainEngine.saved_shards`).
        dtype: The tensors' dtype (`None`: as saved).

    Raises:
        ShardError: the shards do not tile the HF tensors exactly (a region missing or
            held twice, shapes that disagree), or a saved tensor has another shape than
            its spec; the message names the tensor.
    """
    sources: dict[int, list[ShardSpec]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        sources.setdefault(shard.source, []).append(shard.spec)
        for piece in shard.spec.pieces:
            shapes.setdefault(piece.name, piece.global_shape)
    plan = plan_reshard(sources, [ShardSpec.of_slice(n, s) for n, s in shapes.items()],
                        balance=False)  # read the fewest saved parts
    moves: dict[tuple[int, str], list[Transfer]] = {}
    for transfer in plan.transfers:
        moves.setdefault((transfer.src_rank, transfer.src_tensor), []).append(transfer)
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        todo = moves.get((shard.source, shard.spec.local_name))
        if not todo:
            continue
        tensor = shard.read()
        if tuple(tensor.shape) != shard.spec.local_shape:
            raise ShardError(
                f"checkpoint tensor {shard.spec.local_name!r} (part {shard.source}) has shape "
                f"{tuple(tensor.shape)}, its description says {shard.spec.local_shape}; the "
                "checkpoint was written by another model or layout."
            )
        for transfer in todo:
            shape = shapes[transfer.name]
            if _whole(transfer, shape, tensor) and dtype in (None, tensor.dtype):
                out[transfer.name] = tensor
                continue
            target = out.get(transfer.name)
            if target is None:
                target = out[transfer.name] = torch.empty(shape, dtype=dtype or tensor.dtype)
            target[transfer.dst_box.slices()] = tensor[transfer.src_box.slices()]
    return {name: out[name] for name in shapes}
