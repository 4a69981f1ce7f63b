"""Checkpoints of the Megatron engine: one safetensors shard per (tp, pp) rank plus JSON.

Layout of a checkpoint directory:

* `megatron_tp{t}_pp{p}.safetensors` — that rank's parameters under Megatron names;
* `megatron_optim_tp{t}_pp{p}.pt` — the torch optimiser state of that model shard;
* `peerflow_megatron.json` — weight version and the tp/pp/dp layout it was written with.

dp replicas hold identical shards, so only dp-rank 0 writes; every file is written
atomically (`peerflow.checkpoint.atomic_path`). Loading needs the same tp and pp (the
shards are Megatron's own) and is strict: every saved tensor must have exactly the name
and shape of this model's (`peerflow.checkpoint.check_shapes`). Megatron's distributed
optimizer (GPU) is saved with its own `state_dict`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from peerflow.checkpoint import atomic_path, check_shapes, write_json_atomic
from peerflow.errors import ConfigError

META = "peerflow_megatron.json"


def save(engine: Any, directory: str) -> None:
    """Writes `engine`'s shards into `directory` (called on every rank)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    layout = engine.context.layout
    tag = f"tp{engine.tp_rank}_pp{engine.pp_rank}"
    if engine.dp_rank == 0:
        tensors = {n: p.detach().contiguous().clone() for n, p in engine.module.named_parameters()}
        with atomic_path(os.path.join(directory, f"megatron_{tag}.safetensors")) as tmp:
            save_file(tensors, str(tmp))
        with atomic_path(os.path.join(directory, f"megatron_optim_{tag}.pt")) as tmp:
            torch.save(engine.optimizer.state_dict(), tmp)
    if dist.get_rank() == min(layout.global_ranks):
        meta = {"version": engine.version, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
        write_json_atomic(os.path.join(directory, META), meta)
    dist.barrier()


def load(engine: Any, directory: str) -> None:
    """Restores `engine` from `directory` (same tp and pp as when saved)."""
    from safetensors.torch import load_file

    meta_path = os.path.join(directory, META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(
            f"{directory} holds no Megatron checkpoint written by PeerFlow ({META} is "
            "missing); pass the directory save_checkpoint wrote."
        )
    with open(meta_path) as handle:
        meta = json.load(handle)
    layout = engine.context.layout
    if (meta["tp"], meta["pp"]) != (layout.tp, layout.pp):
        raise ConfigError(
            f"checkpoint {directory} has tp={meta['tp']} pp={meta['pp']} but this run has "
            f"tp={layout.tp} pp={layout.pp}; resume with the same trainer layout."
        )
    tag = f"tp{engine.tp_rank}_pp{engine.pp_rank}"
    tensors = load_file(os.path.join(directory, f"megatron_{tag}.safetensors"))
    params = dict(engine.module.named_parameters())
    check_shapes({n: list(t.shape) for n, t in tensors.items()},
                 {n: list(p.shape) for n, p in params.items()}, where=f"{directory} ({tag})")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])
    state = torch.load(os.path.join(directory, f"megatron_optim_{tag}.pt"), weights_only=False)
    engine.optimizer.load_state_dict(state)
    engine.version = int(meta["version"])
