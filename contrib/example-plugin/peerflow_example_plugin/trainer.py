"""`ddp`: a complete train engine, the worked example of CONTRIBUTING.md ("A train engine").

A transformers model, whole on every rank, wrapped in `torch.nn.parallel.
DistributedDataParallel` when the layout has dp > 1. It builds on
`peerflow.training.CausalLMTrainEngine`, so PeerFlow's toolkit supplies the contract
methods (`forward_logprobs`, `train_step`: mini-batches, token-balanced micro-batches,
the global token counts, log-probs at the sampling temperature, the metrics) and the
engine supplies what its framework does: the forward, the backward scaled to DDP's
averaging, the optimiser step, the weights it exports and its checkpoints.
`peerflow conformance ddp` passes every layer with it, the train layer at dp = 1 and 2.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from peerflow import Capabilities, RankCoords, ShardSpec, hf_layout
from peerflow.engines import EngineContext, OptimSettings, SavedShard, tensors_of
from peerflow.errors import ConfigError
from peerflow.training import (
    CausalLMTrainEngine,
    MicroBatch,
    build_adamw,
    build_lr_scheduler,
    torch_dtype,
)

#: What `save_checkpoint` writes: the weights (rank 0), and the rest of the state.
WEIGHTS, STATE = "model.safetensors", "state.pt"


@attrs.frozen(kw_only=True)
class DDPOptions:
    """Options of the `ddp` train engine (`trainer.ddp: {...}`)."""

    share_prompts: bool = True
    """Run the answers of one prompt in one row (4-D masks; `shares_prompts`)."""


class DDPTrainEngine(CausalLMTrainEngine):
    """Data-parallel training of a transformers model with DistributedDataParallel."""

    name: ClassVar[str] = "ddp"
    capabilities: ClassVar[Capabilities] = Capabilities(checkpoint=True)
    options_class: ClassVar[type] = DDPOptions

    def __init__(self, context: EngineContext, options: DDPOptions | None = None,
                 optim: OptimSettings | None = None) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(context, options or DDPOptions(), optim or OptimSettings())
        layout = context.layout
        if layout.world_size != layout.dp:
            raise ConfigError(f"trainer.backend 'ddp' is data parallel only, but the layout is "
                              f"{layout.describe()}; set trainer.layout tp/pp/ep to 1.")
        self.device = torch.device(context.device)
        model = AutoModelForCausalLM.from_pretrained(
            context.model_path, dtype=torch_dtype(context.dtype)).to(self.device)
        self.module = self.prepare_model(model, share_prompts=self.options.share_prompts)
        self.dp_group = context.process_group if layout.dp > 1 else None
        self.model = self.module
        if self.dp_group is not None:  # gradients averaged over dp by every backward
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.module, process_group=self.dp_group)
        self.optimizer = build_adamw(self.module.parameters(), self.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim)

    # -- what the toolkit needs -------------------------------------------------------------

    def forward_micro(self, micro: MicroBatch) -> torch.Tensor:
        """Logits `[B, K, V]` of the positions that predict response tokens.

        `attention_mask_as` is the 4-D mask when the samples of a prompt share a row
        (and the padding mask otherwise); `position_ids` restart for every answer.
        """
        inputs = micro.inputs
        return self.model(input_ids=inputs.input_ids,
                          attention_mask=inputs.attention_mask_as(self.module.dtype),
                          position_ids=inputs.position_ids, use_cache=False,
                          logits_to_keep=inputs.logits_to_keep).logits

    def backward_micro(self, loss: torch.Tensor, micro: MicroBatch) -> None:
        """Backward of `loss` times the dp size: DDP averages, the contract sums."""
        dp = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        (loss * dp).backward()

    def zero_grad(self) -> None:
        """Drops the previous mini-batch's gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Clips to `optim.grad_clip`, steps AdamW and the schedule; the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.lr_scheduler.step()
        return float(norm)

    def current_lr(self) -> float:
        """The rate the next step applies."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_training(self, mode: bool) -> None:
        """`model.train(mode)`."""
        self.model.train(mode)

    # -- weights ---------------------------------------------------------------------------

    def weight_sources(self) -> list[ShardSpec]:
        """Every parameter whole, under the unwrapped model's (HF) names; tied ones once.

        Every dp-rank holds a copy: its dp coordinate is the replica index.
        """
        replica = RankCoords.of(self.context.layout, self.context.rank).dp_rank
        return [ShardSpec.of_slice(name, tuple(p.shape), dtype=str(p.dtype).removeprefix(
            "torch."), replica=replica) for name, p in self.module.named_parameters()]

    @contextlib.contextmanager
    def materialize(self, specs: Sequence[ShardSpec]) -> Iterator[list[torch.Tensor]]:
        """The live parameters of `specs` (no copy, no collective)."""
        named = dict(self.module.named_parameters())
        yield [t.detach() for t in tensors_of(specs, named, self.name)]

    # -- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """Rank 0 writes weights and state (replicas are equal); every rank waits for it."""
        from safetensors.torch import save_file

        if self.context.rank == self.context.layout.global_ranks[0]:
            os.makedirs(directory, exist_ok=True)
            save_file({n: p.detach().cpu().contiguous()
                       for n, p in self.module.named_parameters()},
                      os.path.join(directory, WEIGHTS))
            torch.save({"optimizer": self.optimizer.state_dict(),
                        "lr_scheduler": self.lr_scheduler.state_dict(),
                        "version": self.version}, os.path.join(directory, STATE))
        if self.dp_group is not None:
            dist.barrier(group=self.dp_group)

    def load_checkpoint(self, directory: str) -> None:
        """Every rank reads what rank 0 wrote (weights via the host) onto its own device."""
        from safetensors.torch import load_file

        weights = load_file(os.path.join(directory, WEIGHTS))  # host; copy_ crosses once
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                param.copy_(weights[name])
        state = torch.load(os.path.join(directory, STATE), map_location=self.device,
                           weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.version = int(state["version"])

    @classmethod
    def saved_shards(cls, directory: str, *, model_path: str,
                     options: Any = None) -> list[SavedShard]:
        """The weights file's tensors, whole, under their HF names."""
        from safetensors import safe_open

        path = os.path.join(directory, WEIGHTS)
        with safe_open(path, "pt") as handle:
            shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}
        return [SavedShard.in_file(path, source=0, spec=ShardSpec.of_slice(n, s))
                for n, s in shapes.items()]

    # -- conformance hooks ------------------------------------------------------------------

    @classmethod
    def shard_layout(cls, hf_config: Any, layout: Any, rank: int,
                     dtype: str = "float32") -> list[ShardSpec]:
        """What `weight_sources()` returns on `rank`: every HF tensor, a replica per dp rank."""
        return hf_layout(hf_config, RankCoords.of(layout, rank), dtype=dtype)

    @classmethod
    def conformance_layouts(cls) -> list[Any]:
        """One rank and two dp ranks."""
        from peerflow import ParallelLayout

        return [ParallelLayout(), ParallelLayout(dp=2)]

    @classmethod
    def conformance_families(cls) -> tuple[str, ...]:
        """Dense families whose transformers modules carry the checkpoint's names."""
        return ("llama", "qwen2", "qwen3")

    @classmethod
    def conformance_read_weights(cls, engine: DDPTrainEngine) -> dict[str, torch.Tensor]:
        """The module's own parameters (read around `materialize`)."""
        return dict(engine.module.named_parameters())

    def shutdown(self) -> None:
        """Drops model and optimiser. Safe to call twice."""
        self.model = self.module = self.optimizer = self.lr_scheduler = None
