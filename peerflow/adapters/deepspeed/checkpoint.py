"""Checkpoints of the DeepSpeed engine: DeepSpeed's own files plus PeerFlow's metadata.

`DeepSpeedCheckpoints` gives the engine `save_checkpoint` / `load_checkpoint`.

Every rank writes its ZeRO partition files under `directory/<checkpoint_tag>/` with
DeepSpeed's `save_checkpoint`; dp-rank 0 writes `peerflow_deepspeed.json` (atomically):
the weight version, ZeRO stage, dp size, tag, and the full shape of every parameter.
Loading is strict: the recorded shapes must be exactly the model's
(`peerflow.checkpoint.check_shapes`) before DeepSpeed reads anything, and the dp size must
be the one the checkpoint was written with.

`saved_shards` reads the full-precision weights of any ZeRO stage with DeepSpeed's own
`zero_to_fp32` (`get_fp32_state_dict_from_zero_checkpoint`), in one process, for
`peerflow export`: whole HF tensors, float32 (the optimiser's master copy).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from peerflow.checkpoint import check_same_layout, check_shapes, read_engine_meta, write_json_atomic
from peerflow.engines.train import SavedShard
from peerflow.shard import ShardSpec
from peerflow.training import lora

if TYPE_CHECKING:
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine

META = "peerflow_deepspeed.json"


class DeepSpeedCheckpoints:
    """`save_checkpoint` / `load_checkpoint` of `DeepSpeedTrainEngine` (a mixin)."""

    def _shapes(self: DeepSpeedTrainEngine) -> dict[str, list[int]]:
        return {n: list(self._full_shape(p)) for n, p in self._sync_params().items()}

    def save_checkpoint(self: DeepSpeedTrainEngine, directory: str) -> None:
        """Saves model, optimiser and engine state into `directory` (every rank)."""
        import torch.distributed as dist

        os.makedirs(directory, exist_ok=True)
        tag = self.options.checkpoint_tag
        adapters = self.context.lora is not None
        self.engine.save_checkpoint(directory, tag=tag,
                                    client_state={"peerflow_version": self.version},
                                    exclude_frozen_parameters=adapters)
        if self.dp_rank == 0:
            write_json_atomic(os.path.join(directory, META), {
                "version": self.version, "zero_stage": self.zero_stage,
                "dp_size": self.dp_size, "tag": tag, "shapes": self._shapes(),
                "base_fingerprint": (lora.base_fingerprint(self.context.model_path)
                                     if adapters else None),
            })
        dist.barrier(group=self.dp_group)

    def load_checkpoint(self: DeepSpeedTrainEngine, directory: str) -> None:
        """Restores what `save_checkpoint` wrote (same dp size, same parameter shapes)."""
        meta = read_engine_meta(directory, META, "DeepSpeed")
        check_same_layout({"dp": meta["dp_size"]}, {"dp": self.dp_size}, where=directory)
        check_shapes(meta.get("shapes", {}), self._shapes(), where=directory)
        lora.check_base(meta.get("base_fingerprint"), self.context.model_path, directory)
        path, client = self.engine.load_checkpoint(
            directory, tag=meta["tag"], load_module_strict=self.context.lora is None)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}.")
        self.version = int(client.get("peerflow_version", meta["version"]))

    @classmethod
    def saved_shards(cls, directory: str, *, model_path: str,
                     options: Any = None) -> list[SavedShard]:
        """The checkpoint's float32 weights, whole, through DeepSpeed's `zero_to_fp32`."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        meta = read_engine_meta(directory, META, "DeepSpeed")
        state = get_fp32_state_dict_from_zero_checkpoint(directory, tag=meta["tag"])
        state = {lora.adapter_name(n): t for n, t in state.items()}  # peft's live names
        shapes = meta["shapes"]
        return [SavedShard(source=0, read=lambda name=name: state[name],
                           spec=ShardSpec.of_slice(name, shapes[name]))
                for name in shapes]
