"""`fsdp`: the reference train engine, built on torch FSDP2 and DTensor.

One process: the plain transformers module. Several: every transformer block and then
the root are sharded with `fully_shard` over the dp dimension of the engine's group (gloo
on CPU, NCCL on GPU); with `layout.tp > 1` the blocks' projections are first split with
`parallelize_module` (column-parallel q/k/v/gate/up, row-parallel o/down).

Micro-batching, log-probs at the sampling temperature, metrics and the step loop are the
training toolkit's (`peerflow.training.CausalLMTrainEngine`); this module supplies the
FSDP2 forward, backward and optimiser step.

As a critic (`fsdp: {value_head: true}`) the engine puts a scalar head on the backbone;
`forward_values` returns one value per response token (the value of the state *before*
the token, i.e. read at the position that predicts it), and `train_step` hands the loss
those values with gradients in place of log-probs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

import attrs
import torch
import torch.distributed as dist

from peerflow.adapters.fsdp import checkpoint as ckpt
from peerflow.adapters.fsdp.layout import FAMILIES, fsdp_shard_layout
from peerflow.adapters.fsdp.model import apply_fsdp, apply_tensor_parallel, load_module
from peerflow.adapters.fsdp.optim import clip_grad_norm
from peerflow.adapters.fsdp.shards import (
    local_box,
    local_tensor,
    named_shard_specs,
    replica_index,
)
from peerflow.capabilities import Capabilities
from peerflow.engines import EngineContext, OptimSettings, SavedShard
from peerflow.engines.train import tensors_of
from peerflow.errors import ConfigError
from peerflow.models.packed_experts import as_declared, canonical_specs
from peerflow.shard import ShardSpec
from peerflow.training import (
    CausalLMTrainEngine,
    MicroBatch,
    build_adamw,
    build_lr_scheduler,
    lora,
    torch_dtype,
)


@attrs.frozen(kw_only=True)
class FSDPTrainOptions:
    """Options of the `fsdp` train engine (`trainer.fsdp: {...}`)."""

    renamed_keys: ClassVar[dict[str, str]] = {
        "gradient_checkpointing": "set trainer.activation_checkpointing: true instead (one "
                                  "knob for every train backend)."}
    """Keys this section once had, and what replaced them (said by `config validate`)."""

    value_head: bool = False
    """Build a critic: the backbone plus a scalar value head (PPO's `values` and
    `train_critic` nodes); `forward_values` then works and `forward_logprobs` does not."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3 style); `False` keeps them
    until backward (ZeRO-2 style, more memory, one all-gather less per micro-batch); a
    forward without backward (log-probs, values) reshards after it."""
    attn_implementation: str | None = None
    """transformers attention backend (`sdpa`, `eager`); `None` lets transformers pick."""
    share_prompts: bool = True
    """Run a prompt once for all its samples in a micro-batch (one row `[prompt, answer_1,
    answer_2, …]` with a mask keeping answers apart; `peerflow.training.shared_prompts`):
    the same log-probs and gradients over fewer positions. Actors only (not `value_head`),
    and only under an attention backend that takes a custom 4D mask (`sdpa`, `eager`);
    under another (`flash_attention_2`) samples keep a row each, with a log line."""
    param_dtype: Literal["bfloat16", "float32"] | None = None
    """FSDP2 `MixedPrecisionPolicy.param_dtype` (sharded runs): the dtype blocks compute in;
    `None`: bfloat16 under `trainer.bf16`, else the model's dtype."""
    reduce_dtype: Literal["bfloat16", "float32"] | None = None
    """FSDP2 `MixedPrecisionPolicy.reduce_dtype` (sharded runs): the dtype gradients are
    reduce-scattered in; `None`: float32 under `trainer.bf16`, else `param_dtype`'s."""
    cpu_offload: bool = False
    """FSDP2 `CPUOffloadPolicy` (sharded runs): sharded parameters, gradients and the
    optimiser step stay in host memory; each block is gathered to the device to compute."""


class FSDPTrainEngine(CausalLMTrainEngine):
    """Trains a transformers model with FSDP2 (and optional DTensor tensor parallelism)."""

    name: ClassVar[str] = "fsdp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        tensor_parallel=True, value_head=True, checkpoint=True, lora=True, padding_free=True,
        activation_checkpointing=True, routing_replay=True)
    options_class: ClassVar[type] = FSDPTrainOptions

    def __init__(
        self,
        context: EngineContext,
        options: FSDPTrainOptions | None = None,
        optim: OptimSettings | None = None,
    ) -> None:
        options = options if options is not None else FSDPTrainOptions()
        super().__init__(context, options, optim or OptimSettings())
        layout = context.layout
        if layout.pp > 1 or layout.ep > 1 or layout.cp > 1:
            raise ConfigError(
                f"trainer.backend 'fsdp' supports dp and tp only, but the layout is "
                f"{layout.describe()}; set trainer.layout pp/ep to 1 or use megatron."
            )
        self.device = context.device
        group = context.process_group
        self.distributed = group is not None and dist.get_world_size(group) > 1
        if self.distributed and dist.get_world_size(group) != layout.world_size:
            raise ConfigError(
                f"EngineContext.process_group has {dist.get_world_size(group)} ranks but the "
                f"layout {layout.describe()} has {layout.world_size}; pass the group of "
                "layout.global_ranks."
            )
        if not self.distributed and layout.world_size > 1:
            raise ConfigError(
                f"fsdp layout {layout.describe()} spans several ranks but EngineContext."
                "process_group is None; start torch.distributed and pass the group."
            )
        coord = layout.coord(context.rank) if self.distributed else None
        self._coords = {"dp": coord.dp, "tp": coord.tp} if coord else {"dp": 0, "tp": 0}
        self._sizes = {"dp": layout.dp, "tp": layout.tp}
        self.bf16 = self.optim.bf16
        self._compute_dtype = torch.bfloat16 if self.bf16 else torch_dtype(context.dtype)
        torch.manual_seed(context.seed)  # identical value-head init on every rank
        self.model = load_module(
            context.model_path,
            value_head=self.options.value_head,
            dtype=torch_dtype(context.dtype),
            attn_implementation=self.options.attn_implementation,
        ).to(self.device)
        self.model = self.prepare_model(
            self.model, share_prompts=self.options.share_prompts,
            backbone=self.model.model if self.options.value_head else None)
        self.dp_group = None
        if self.distributed:
            self._shard(group)
        elif self.options.cpu_offload or self.options.param_dtype or self.options.reduce_dtype:
            warnings.warn("trainer.fsdp cpu_offload/param_dtype/reduce_dtype apply to sharded "
                          "runs (dp*tp > 1); this one-process engine ignores them.",
                          stacklevel=2)
        # The fused update is one kernel call over every parameter where torch's default
        # runs ~10 multi-tensor ops, each re-planned by DTensor's dispatcher every step.
        # Both group tensors across DTensor meshes, which tensor parallelism's mixed
        # meshes forbid: tp > 1 takes the per-parameter loop.
        self.optimizer = build_adamw(self.model.parameters(), self.optim,
                                     fused=True if layout.tp == 1 else None,
                                     foreach=None if layout.tp == 1 else False)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim)

    def _shard(self, group: Any) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        layout = self.context.layout
        device_type = self.device.type
        if layout.tp == 1:
            mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))
            dp_mesh = mesh
        else:
            # Creating the dp and tp sub-groups is collective over the default group:
            # every rank of the job builds the engine (the colocated placement does).
            ranks = torch.tensor(layout.global_ranks).reshape(layout.dp, layout.tp)
            mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("dp", "tp"))
            dp_mesh = mesh["dp"]
            apply_tensor_parallel(self.model, mesh["tp"])
        self.dp_group = dp_mesh.get_group()
        options = self.options
        bf16 = torch.bfloat16 if self.bf16 else None
        param_dtype = getattr(torch, options.param_dtype) if options.param_dtype else bf16
        reduce_dtype = getattr(torch, options.reduce_dtype) if options.reduce_dtype \
            else torch.float32 if self.bf16 else None
        apply_fsdp(self.model, dp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   cpu_offload=options.cpu_offload,
                   reshard_after_forward=options.reshard_after_forward)
        self._compute_dtype = param_dtype or self._compute_dtype

    # -- what the training toolkit needs ---------------------------------------------------

    @property
    def produces_values(self) -> bool:  # type: ignore[override]
        """A critic (`value_head: true`) outputs values instead of logits."""
        return self.options.value_head

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.bf16 and not self.distributed:  # FSDP's MixedPrecisionPolicy casts instead
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_micro(self, micro: MicroBatch) -> torch.Tensor:
        """Logits `[B, K, V]` (values `[B, L]` for a critic) of one padded micro-batch.

        Only the last `K = logits_to_keep` positions, those that predict response tokens,
        go through the vocabulary projection.

        Gradient sync is switched on for the last micro-batch of a mini-batch only, so
        FSDP reduce-scatters once per optimiser step.
        """
        if self.distributed:
            self.model.set_requires_gradient_sync(micro.last)
        inputs = micro.inputs
        ids, mask = inputs.input_ids, inputs.attention_mask_as(self._compute_dtype)
        with self._autocast():
            if self.options.value_head:
                return self.model(input_ids=ids, attention_mask=mask,
                                  position_ids=inputs.position_ids)
            return self.model(input_ids=ids, attention_mask=mask,
                              position_ids=inputs.position_ids,
                              use_cache=False, logits_to_keep=inputs.logits_to_keep).logits

    def forward_logprobs(self, batch: Any) -> Any:
        """See `CausalLMTrainEngine.forward_logprobs`; leaves the parameters sharded."""
        with self._resharded():
            return super().forward_logprobs(batch)

    def forward_values(self, batch: Any) -> Any:
        """See `CausalLMTrainEngine.forward_values`; leaves the parameters sharded."""
        with self._resharded():
            return super().forward_values(batch)

    @contextlib.contextmanager
    def _resharded(self) -> Iterator[None]:
        """Reshards after a forward without backward when `reshard_after_forward` is off.

        FSDP2 then keeps the gathered parameters for the backward, and only a backward
        frees them; a no-grad pass would leave them gathered (the memory, and a weight
        sync or checkpoint reading whole tensors where shards are expected).
        """
        try:
            yield
        finally:
            if self.distributed and not self.options.reshard_after_forward:
                from torch.distributed.fsdp import FSDPModule

                for module in self.model.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    def backward_micro(self, loss: torch.Tensor, micro: MicroBatch) -> None:
        """Backward of `loss` times the dp size.

        FSDP averages gradients over dp; the loss is already globally normalised, so the
        scale turns the average into the sum.
        """
        dp = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        (loss * dp).backward()

    def zero_grad(self) -> None:
        """Drops the previous mini-batch's gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Global-norm clip (DTensor-aware), one AdamW step, one schedule step; the norm."""
        norm = clip_grad_norm(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.lr_scheduler.step()
        return norm

    def current_lr(self) -> float:
        """AdamW's learning rate."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_training(self, mode: bool) -> None:
        """`model.train(mode)`."""
        self.model.train(mode)

    # -- weights and checkpoints ----------------------------------------------------------

    def _named_params(self) -> list[tuple[str, torch.Tensor]]:
        if self.context.lora is not None and not self.options.value_head:
            return lora.adapter_parameters(self.model)
        return list(self.model.named_parameters())

    def weight_sources(self) -> list[ShardSpec]:
        """This rank's local shard of every parameter (tied parameters once).

        With `trainer.lora`, of every adapter tensor only (peft's names).
        """
        specs, _ = named_shard_specs(self._named_params(), self._coords, self._sizes)
        # MoE: packed experts described one by one (a value-head wrapper has no config)
        return canonical_specs(getattr(self.model, "config", {}), specs)

    @contextlib.contextmanager
    def materialize(self, specs: Sequence[ShardSpec]) -> Iterator[list[torch.Tensor]]:
        """Yields the live local shards of `specs` (no copy, no collective).

        Their boxes are the specs' own (`weight_sources`); `run_plan` checks the shapes.
        """
        params = tensors_of(specs, dict(self._named_params()), self.name)
        yield [as_declared(local_tensor(param).detach(), spec)
               for param, spec in zip(params, specs, strict=True)]

    def _base_fingerprint(self) -> str | None:
        """With `trainer.lora`: the base weights the saved adapters belong to."""
        if self.context.lora is None or self.options.value_head:
            return None
        return lora.base_fingerprint(self.context.model_path)

    def _group_rank(self) -> tuple[int, int]:
        layout = self.context.layout
        if not self.distributed:
            return 0, 1
        return layout.global_ranks.index(self.context.rank), layout.world_size

    def save_checkpoint(self, directory: str) -> None:
        """Writes model, AdamW state and RNG state (see `checkpoint`); all ranks call it."""
        rank, world = self._group_rank()
        params = [
            (name, p, replica_index(p, self._coords, self._sizes))
            for name, p in self._named_params()
        ]
        ckpt.save_shards(
            directory,
            rank=rank,
            world_size=world,
            params=params,
            optimizer=self.optimizer,
            extra={"version": self.version, "layout": self.context.layout.describe(),
                   "base_fingerprint": self._base_fingerprint(),
                   "lr_scheduler": self.lr_scheduler.state_dict()},
        )
        if self.distributed:
            dist.barrier(group=self.context.process_group)

    def load_checkpoint(self, directory: str) -> None:
        """Restores what `save_checkpoint` wrote, onto this engine's layout."""
        rank, world = self._group_rank()
        lora.check_base(ckpt.read_meta(directory)[0].get("base_fingerprint"),
                        self.context.model_path, directory)
        meta = ckpt.load_shards(
            directory,
            rank=rank,
            world_size=world,
            params=self._named_params(),
            optimizer=self.optimizer,
        )
        self.version = int(meta.get("version", 0))
        if "lr_scheduler" in meta:  # checkpoints before schedules ran at a constant lr
            self.lr_scheduler.load_state_dict(meta["lr_scheduler"])

    @classmethod
    def saved_shards(cls, directory: str, *, model_path: str,
                     options: Any = None) -> list[SavedShard]:
        """Every saving rank's shards, under HF names already (see `checkpoint`)."""
        return ckpt.saved_shards(directory)

    # -- conformance hooks (read by peerflow.conformance; see its profile module) ---------

    @classmethod
    def shard_layout(cls, hf_config: Any, layout: Any, rank: int) -> list[ShardSpec]:
        """What `weight_sources()` returns on `rank` of `layout` (see `layout.py`)."""
        return fsdp_shard_layout(hf_config, layout, rank)

    @classmethod
    def conformance_families(cls) -> tuple[str, ...]:
        """Model families whose weights the engine exports as canonical HF tensors."""
        return FAMILIES

    @classmethod
    def conformance_read_weights(cls, engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
        """The live local shards, read from the module itself (bypassing `materialize`)."""
        return {name: local_box(p)[1] for name, p in engine.model.named_parameters()}

    def shutdown(self) -> None:
        """Drops model and optimiser state. Safe to call twice."""
        self.optimizer = self.lr_scheduler = None
        self.model = None
