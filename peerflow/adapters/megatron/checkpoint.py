"""Checkpoints of the Megatron engine: one safetensors shard per (tp, pp) rank plus JSON.

Layout of a checkpoint directory:

* `megatron_tp{t}_pp{p}.safetensors` — that rank's parameters under Megatron names
  (`megatron_tp{t}_pp{p}_ep{e}` with expert parallelism: each ep rank's file holds its
  own experts and, like every ep rank, the dense tensors);
* `megatron_optim_tp{t}_pp{p}.safetensors` + `.json` — the optimiser state of that model
  shard (its tensors, and its structure as JSON: `peerflow.checkpoint.tensor_tree`), no
  pickle. Checkpoints PeerFlow 0.1.0 wrote hold `megatron_optim_tp{t}_pp{p}.pt`, a
  torch pickle: it is read through `peerflow.checkpoint.pickles.safe_load` (torch's
  restricted unpickler; a file it refuses needs `--trust-checkpoint`);
* `peerflow_megatron.json` — weight version, the tp/pp/ep/dp layout it was written with
  and the vocabulary padding multiple.

dp replicas hold identical shards, so only dp-rank 0 writes; every file is written
atomically (`peerflow.checkpoint.atomic_path`). Loading needs the same tp and pp (the
shards are Megatron's own) and is strict: every saved tensor must have exactly the name
and shape of this model's (`peerflow.checkpoint.check_shapes`). Megatron's distributed
optimizer (GPU) is saved with its own `state_dict`. Loading needs the same ep too.
`MegatronCheckpoints` gives the engine `save_checkpoint` / `load_checkpoint`, and
`saved_shards` describes every (tp, pp, ep) file
as pieces of HF tensors (the same `megatron_layout` specs the weight sync uses) for
`peerflow export`.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any

import torch

from peerflow.checkpoint import (
    atomic_path,
    check_same_layout,
    check_shapes,
    read_engine_meta,
    write_json_atomic,
)
from peerflow.checkpoint.pickles import safe_load
from peerflow.checkpoint.tensor_tree import load_tree, save_tree, tree_exists
from peerflow.engines.train import SavedShard
from peerflow.errors import ConfigError

if TYPE_CHECKING:
    from peerflow.adapters.megatron.engine import MegatronTrainEngine

META = "peerflow_megatron.json"


class MegatronCheckpoints:
    """`save_checkpoint` / `load_checkpoint` of `MegatronTrainEngine` (a mixin)."""

    def save_checkpoint(self: MegatronTrainEngine, directory: str) -> None:
        """Saves this rank's model shard (safetensors) and optimiser state (every rank)."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        layout = self.context.layout
        tag = _tag(self.tp_rank, self.pp_rank, self.ep_rank, layout.ep)
        if self.dp_rank == 0:
            tensors = {n: p.detach().contiguous().clone()
                       for n, p in self.module.named_parameters()}
            with atomic_path(os.path.join(directory, f"megatron_{tag}.safetensors")) as tmp:
                save_file(tensors, str(tmp))
            save_tree(self.optimizer.state_dict(),
                      os.path.join(directory, f"megatron_optim_{tag}"))
        if dist.get_rank() == min(layout.global_ranks):
            meta = {"version": self.version, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                    "ep": layout.ep,
                    "vocab_multiple": self.options.vocab_multiple,
                    "lr_scheduler": [sched.state_dict() for sched in self.lr_schedulers]}
            write_json_atomic(os.path.join(directory, META), meta)
        dist.barrier()

    def load_checkpoint(self: MegatronTrainEngine, directory: str) -> None:
        """Restores what `save_checkpoint` wrote (same tp and pp, same parameter shapes)."""
        from safetensors.torch import load_file

        meta = read_engine_meta(directory, META, "Megatron")
        layout = self.context.layout
        check_same_layout({"tp": meta["tp"], "pp": meta["pp"], "ep": meta.get("ep", 1)},
                          {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep}, where=directory)
        tag = _tag(self.tp_rank, self.pp_rank, self.ep_rank, layout.ep)
        tensors = load_file(os.path.join(directory, f"megatron_{tag}.safetensors"))
        params = dict(self.module.named_parameters())
        check_shapes({n: list(t.shape) for n, t in tensors.items()},
                     {n: list(p.shape) for n, p in params.items()}, where=f"{directory} ({tag})")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(tensors[name])
        self.optimizer.load_state_dict(_optimizer_state(directory, tag))
        for sched, saved in zip(self.lr_schedulers, meta.get("lr_scheduler", []), strict=False):
            sched.load_state_dict(saved)  # older checkpoints ran at a constant lr: none saved
        self.version = int(meta["version"])

    @classmethod
    def saved_shards(cls, directory: str, *, model_path: str,
                     options: Any = None) -> list[SavedShard]:
        """Every (tp, pp, ep) file's tensors as pieces of HF tensors (dp replica 0's specs)."""
        from transformers import AutoConfig

        from peerflow.adapters.megatron.layout import megatron_shard_layout
        from peerflow.layout import ParallelLayout

        meta = read_engine_meta(directory, META, "Megatron")
        ep = meta.get("ep", 1)
        _check_files_hold(directory, meta["tp"], meta["pp"], ep)
        layout = ParallelLayout(tp=meta["tp"], pp=meta["pp"], dp=meta["dp"], ep=ep)
        multiple = meta.get("vocab_multiple", getattr(options, "vocab_multiple", 128))
        hf_config = AutoConfig.from_pretrained(model_path)
        shards = []
        for tp, pp, e in itertools.product(range(layout.tp), range(layout.pp), range(ep)):
            rank = layout.rank_at(tp=tp, pp=pp, ep=e, dp=0)
            path = os.path.join(directory, f"megatron_{_tag(tp, pp, e, ep)}.safetensors")
            for spec in megatron_shard_layout(hf_config, layout, rank, vocab_multiple=multiple):
                shards.append(SavedShard.in_file(path, source=rank, spec=spec))
        return shards


def _optimizer_state(directory: str, tag: str) -> Any:
    """The saved optimiser state of shard `tag`: safetensors + JSON, or an old `.pt`."""
    stem = os.path.join(directory, f"megatron_optim_{tag}")
    if tree_exists(stem):
        return load_tree(stem)
    return safe_load(f"{stem}.pt")  # PeerFlow 0.1.0 wrote a pickle


def _check_files_hold(directory: str, tp: Any, pp: Any, ep: Any) -> None:
    """Refuses a layout (from the JSON sidecar) whose shard files are not all there.

    Checked before anything loops over the layout: a sidecar claiming `tp: 1e9` made
    `saved_shards` build specs until memory ran out.
    """
    degrees = {"tp": tp, "pp": pp, "ep": ep}
    held = {name for name in os.listdir(directory)
            if name.startswith("megatron_tp") and name.endswith(".safetensors")}
    fits = all(type(v) is int and v >= 1 for v in degrees.values()) and tp * pp * ep <= len(held)
    names = [f"megatron_{_tag(t, p, e, ep)}.safetensors"
             for t, p, e in itertools.product(range(tp), range(pp), range(ep))] if fits else []
    missing = [name for name in names if name not in held]
    if not fits or missing:
        raise ConfigError(
            f"{os.path.join(directory, META)} describes tp={tp!r}, pp={pp!r}, ep={ep!r}, "
            f"which the directory's {len(held)} megatron_tp*.safetensors files do not hold"
            f"{f' (missing {missing[:3]})' if missing else ''}: not a checkpoint "
            "save_checkpoint wrote (corrupt, or crafted); pass the directory it wrote.")


def _tag(tp: int, pp: int, ep_rank: int, ep: int) -> str:
    """A shard file's tag: `tp{t}_pp{p}`, with `_ep{e}` under expert parallelism."""
    return f"tp{tp}_pp{pp}" + (f"_ep{ep_rank}" if ep > 1 else "")
