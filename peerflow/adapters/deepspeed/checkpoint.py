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

DeepSpeed's files are torch pickles, and DeepSpeed 0.19 reads them with
`torch.load(weights_only=False)`: a crafted file would run code. So DeepSpeed never
unpickles them itself here. `load_checkpoint` hands DeepSpeed a checkpoint engine whose
`load` is `peerflow.checkpoint.pickles.safe_load` (torch's restricted unpickler, allowing
the few DeepSpeed classes the files hold: `DEEPSPEED_GLOBALS`), and `saved_shards`
checks every file `zero_to_fp32` opens with that loader first. A refused file raises
`UntrustedCheckpointError` naming it, unless `--trust-checkpoint` was given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from peerflow.checkpoint import check_same_layout, check_shapes, read_engine_meta, write_json_atomic
from peerflow.checkpoint.pickles import check_files, safe_load
from peerflow.engines.train import SavedShard
from peerflow.shard import ShardSpec
from peerflow.training import lora

if TYPE_CHECKING:
    from peerflow.adapters.deepspeed.engine import DeepSpeedTrainEngine

META = "peerflow_deepspeed.json"
#: The classes DeepSpeed's own checkpoint files hold besides tensors and containers.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
)


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine with `load` through the restricted unpickler.

    Saving, committing and everything else stay DeepSpeed's own (`inner`'s).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        """`torch.load(path)` with `weights_only=True` (`peerflow.checkpoint.pickles`)."""
        return safe_load(path, allowed=DEEPSPEED_GLOBALS, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _tag_files(directory: str, tag: str) -> list[Path]:
    """Every torch file DeepSpeed may read of checkpoint `tag` (its `*.pt`, sorted)."""
    return sorted(p for p in Path(directory, tag).rglob("*.pt") if p.is_file())


class DeepSpeedCheckpoints:
    """`save_checkpoint` / `load_checkpoint` of `DeepSpeedTrainEngine` (a mixin)."""

    #: See `peerflow.checkpoint.pickles`: what `verify` lets these files hold.
    checkpoint_globals: ClassVar[tuple[str, ...]] = DEEPSPEED_GLOBALS

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
        check_files(_tag_files(directory, meta["tag"]), allowed=DEEPSPEED_GLOBALS)
        if not isinstance(self.engine.checkpoint_engine, SafeCheckpointEngine):
            self.engine.checkpoint_engine = SafeCheckpointEngine(self.engine.checkpoint_engine)
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
        check_files(_tag_files(directory, meta["tag"]), allowed=DEEPSPEED_GLOBALS)
        state = get_fp32_state_dict_from_zero_checkpoint(directory, tag=meta["tag"])
        state = {lora.adapter_name(n): t for n, t in state.items()}  # peft's live names
        shapes = meta["shapes"]
        return [SavedShard(source=0, read=lambda name=name: state[name],
                           spec=ShardSpec.of_slice(name, shapes[name]))
                for name in shapes]
