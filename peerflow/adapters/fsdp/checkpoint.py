"""FSDP train-engine checkpoints: per-rank safetensors shards plus JSON metadata.

Every rank writes (each file atomically, through `peerflow.checkpoint.atomic_path`):

* `model-rank{r}.safetensors` — its local shard of every parameter, keyed by HF name;
* `optim-rank{r}.safetensors` — its shard of AdamW's `exp_avg` / `exp_avg_sq`
  (`{name}::exp_avg`), the step counts, and its RNG states (`rng::cpu`, `rng::cuda`);
* `meta-rank{r}.json` — the global box of every saved tensor, its replica index, the
  optimiser hyper-parameters, the engine version and the world size.

Loading first checks that the saved tensors are exactly the model's (same names, same
global shapes: `peerflow.checkpoint.check_shapes`), then reads the box metadata of every
saved rank and copies each overlapping region into this rank's shard, so a checkpoint
loads onto a different dp/tp layout too; only the regions of replica 0 are read, and every
local element must be covered exactly once.
`saved_shards` describes the files as HF-named shards (the boxes are HF regions already)
for `peerflow export`.
RNG states are restored only when the layout is unchanged (same world size). On CPU a
reload reproduces parameters, optimiser moments and step counts bit for bit, so training
resumes exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from peerflow.adapters.fsdp.shards import local_box
from peerflow.checkpoint import atomic_path, check_shapes, write_json_atomic
from peerflow.engines.train import SavedShard
from peerflow.shard import Box, ShardSpec

FORMAT = "peerflow-fsdp/1"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))


def save_shards(
    directory: str,
    *,
    rank: int,
    world_size: int,
    params: Sequence[tuple[str, torch.Tensor, int]],
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
) -> None:
    """Writes this rank's part of a checkpoint (call on every rank).

    Args:
        directory: Checkpoint directory (created if missing; shared by all ranks).
        rank: This rank's index in the engine group.
        world_size: Ranks in the engine group.
        params: `(hf_name, parameter, replica)` for every parameter, tied ones once.
        optimizer: The AdamW optimiser over those parameters.
        extra: JSON-able engine state (version, layout) stored in the metadata.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {"rng::cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        optim["rng::cuda"] = torch.cuda.get_rng_state()
    boxes: dict[str, Any] = {}
    for name, param, replica in params:
        box, local = local_box(param)
        if box.numel == 0:
            continue
        model[name] = local
        boxes[name] = {
            "global_shape": list(param.shape),
            "offsets": list(box.offsets),
            "sizes": list(box.sizes),
            "replica": replica,
        }
        state = optimizer.state.get(param, {})
        for key in _MOMENTS:
            if key in state:
                optim[f"{name}::{key}"] = local_box(state[key])[1]
        if "step" in state:
            optim[f"{name}::step"] = torch.as_tensor(state["step"]).reshape(1).float()
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    _atomic_save_tensors(model, out / f"model-rank{rank}.safetensors")
    _atomic_save_tensors(optim, out / f"optim-rank{rank}.safetensors")
    meta = {
        "format": FORMAT,
        "rank": rank,
        "world_size": world_size,
        "boxes": boxes,
        "param_groups": json.loads(json.dumps(hyper, default=_json_default)),
        **extra,
    }
    write_json_atomic(out / f"meta-rank{rank}.json", meta)


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def read_meta(directory: str) -> list[dict[str, Any]]:
    """Returns the metadata of every rank of the saving run, in rank order.

    Raises:
        FileNotFoundError: `directory` holds no complete fsdp checkpoint.
    """
    root = Path(directory)
    first = root / "meta-rank0.json"
    if not first.exists():
        raise FileNotFoundError(
            f"{directory!r} holds no fsdp checkpoint (no meta-rank0.json); pass a directory "
            "written by FSDPTrainEngine.save_checkpoint."
        )
    world = json.loads(first.read_text())["world_size"]
    metas = []
    for r in range(world):
        path = root / f"meta-rank{r}.json"
        if not path.exists():
            raise FileNotFoundError(
                f"fsdp checkpoint {directory!r} was saved by {world} ranks but {path.name} "
                "is missing; the save was interrupted, use an earlier checkpoint."
            )
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}.")
        metas.append(meta)
    return metas


def saved_shards(directory: str) -> list[SavedShard]:
    """Every rank's model shard in `directory` as `(HF box, lazy reader)` (no optimiser).

    Raises:
        FileNotFoundError: `directory` holds no complete fsdp checkpoint.
    """
    shards = []
    for meta in read_meta(directory):
        path = str(Path(directory) / f"model-rank{meta['rank']}.safetensors")
        for name, info in meta["boxes"].items():
            box = Box(offsets=info["offsets"], sizes=info["sizes"])
            spec = ShardSpec.of_slice(name, info["global_shape"], box, replica=info["replica"])
            shards.append(SavedShard.in_file(path, source=meta["rank"], spec=spec))
    return shards


def _fill(
    target: torch.Tensor,
    target_box: Box,
    name: str,
    key: str,
    metas: list[dict[str, Any]],
    files: dict[int, Any],
) -> None:
    """Copies every saved replica-0 region of `name` overlapping `target_box`.

    `target` is the local shard whose global box is `target_box`; `key` is the tensor's
    key in the saved files.
    """
    covered = 0
    for meta in metas:
        info = meta["boxes"].get(name)
        if info is None or info["replica"] != 0:
            continue
        handle = files[meta["rank"]]
        if key not in handle.keys():
            raise KeyError(f"fsdp checkpoint rank {meta['rank']} lacks {key!r}.")
        saved = Box(offsets=info["offsets"], sizes=info["sizes"])
        common = saved.intersect(target_box)
        if common is None:
            continue
        source = handle.get_slice(key)[common.shift([-o for o in saved.offsets]).slices()]
        target[common.shift([-o for o in target_box.offsets]).slices()].copy_(source)
        covered += common.numel
    if covered != target_box.numel:
        raise ValueError(
            f"fsdp checkpoint covers {covered} of the {target_box.numel} elements of {name!r} "
            f"box {target_box} ({key}); the checkpoint is incomplete or of another model."
        )


def load_shards(
    directory: str,
    *,
    rank: int,
    world_size: int,
    params: Sequence[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Restores this rank's shards from a checkpoint (call on every rank).

    Args:
        directory: What `save_shards` wrote (any saving layout).
        rank: This rank's index in the engine group.
        world_size: Ranks in the engine group now.
        params: `(hf_name, parameter)` of this engine, tied ones once.
        optimizer: The engine's optimiser; its state is (re)created.

    Returns:
        The metadata of the saving rank with this rank's index (rank 0 if absent).
    """
    from safetensors import safe_open

    metas = read_meta(directory)
    root = Path(directory)
    model_files = {m["rank"]: safe_open(str(root / f"model-rank{m['rank']}.safetensors"), "pt")
                   for m in metas}
    optim_files = {m["rank"]: safe_open(str(root / f"optim-rank{m['rank']}.safetensors"), "pt")
                   for m in metas}
    saved = {n: info["global_shape"] for m in metas for n, info in m["boxes"].items()}
    check_shapes(saved, {name: list(param.shape) for name, param in params}, where=directory)
    with torch.no_grad():
        for name, param in params:
            box, local = local_box(param)
            if box.numel:
                _fill(local, box, name, name, metas, model_files)
            step = _saved_step(name, metas, optim_files)
            if step is None:
                optimizer.state.pop(param, None)
                continue
            state = {"step": torch.tensor(step, dtype=torch.float32)}
            for key in _MOMENTS:
                moment = torch.zeros_like(param)
                _, moment_local = local_box(moment)
                if box.numel:
                    _fill(moment_local, box, name, f"{name}::{key}", metas, optim_files)
                state[key] = moment
            optimizer.state[param] = state
    for group, saved in zip(optimizer.param_groups, metas[0]["param_groups"], strict=True):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    own = metas[rank] if len(metas) == world_size and rank < len(metas) else metas[0]
    if len(metas) == world_size:
        rng = optim_files[rank]
        torch.set_rng_state(rng.get_tensor("rng::cpu"))
        if "rng::cuda" in rng.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng.get_tensor("rng::cuda"))
    return own


def _saved_step(name: str, metas: list[dict[str, Any]], files: dict[int, Any]) -> float | None:
    for meta in metas:
        handle = files[meta["rank"]]
        if f"{name}::step" in handle.keys():
            return float(handle.get_tensor(f"{name}::step")[0])
    return None
