"""`fsdp`: the reference train engine, built on torch FSDP2 and DTensor.

One process: the plain transformers module. Several: every transformer block and then
the root are sharded with `fully_shard` over the dp dimension of the engine's group (gloo
on CPU, NCCL on GPU); with `layout.tp > 1` the blocks' projections are first split with
`parallelize_module` (column-parallel q/k/v/gate/up, row-parallel o/down).

Log-probs are `log_softmax` of the model's logits at temperature 1 for every response
token, the same quantity the `hf` rollout engine reports, so PPO ratios start at 1.
As a critic (`fsdp: {value_head: true}`) the engine puts a scalar head on the backbone;
`forward_values` returns one value per response token (the value of the state *before*
the token, i.e. read at the position that predicts it), and `train_step` hands the loss
those values with gradients in place of log-probs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from peerflow.adapters.fsdp import checkpoint as ckpt
from peerflow.adapters.fsdp.layout import FAMILIES, fsdp_shard_layout
from peerflow.adapters.fsdp.model import apply_fsdp, apply_tensor_parallel, load_module
from peerflow.adapters.fsdp.optim import build_adamw, clip_grad_norm
from peerflow.adapters.fsdp.packing import agree_micro_batches, padded_inputs
from peerflow.adapters.fsdp.shards import local_box, named_shard_specs, replica_index
from peerflow.batch import Batch, RaggedField
from peerflow.capabilities import Capabilities
from peerflow.engines import EngineContext, LossFunction, OptimSettings, TrainEngine
from peerflow.errors import ConfigError
from peerflow.shard import ShardSpec


@attrs.frozen(kw_only=True)
class FSDPTrainOptions:
    """Options of the `fsdp` train engine (`trainer.fsdp: {...}`)."""

    value_head: bool = False
    """Build a critic: the backbone plus a scalar value head (PPO's `values` and
    `train_critic` nodes); `forward_values` then works and `forward_logprobs` does not."""
    gradient_checkpointing: bool = False
    """Recompute block activations in backward (less memory, ~30% more compute)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3 style); `False` keeps them
    until backward (ZeRO-2 style, more memory, one all-gather less per micro-batch)."""
    attn_implementation: str | None = None
    """transformers attention backend (`sdpa`, `eager`); `None` lets transformers pick."""


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(
            f"EngineContext.dtype={name!r} is not a torch floating-point dtype; use float32 "
            "or bfloat16."
        )
    return dtype


class FSDPTrainEngine(TrainEngine):
    """Trains a transformers model with FSDP2 (and optional DTensor tensor parallelism)."""

    name: ClassVar[str] = "fsdp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        tensor_parallel=True, value_head=True, checkpoint=True
    )
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
        self.device = torch.device(context.device)
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
        self.bf16 = self.optim.bf16 and self._bf16_supported()
        torch.manual_seed(context.seed)  # identical value-head init on every rank
        self.model = load_module(
            context.model_path,
            value_head=self.options.value_head,
            dtype=_torch_dtype(context.dtype),
            attn_implementation=self.options.attn_implementation,
        ).to(self.device)
        if self.options.gradient_checkpointing:
            target = self.model.model if self.options.value_head else self.model
            target.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self._dp_group = None
        if self.distributed:
            self._shard(group)
        self.optimizer = build_adamw(
            (p for p in self.model.parameters() if p.requires_grad),
            self.optim,
            mixed_meshes=layout.tp > 1,
        )

    def _bf16_supported(self) -> bool:
        if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            warnings.warn("bf16 requested but this GPU lacks bfloat16; training in float32.")
            return False
        return True

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
        self._dp_group = dp_mesh.get_group()
        apply_fsdp(
            self.model,
            dp_mesh,
            bf16=self.bf16,
            reshard_after_forward=self.options.reshard_after_forward,
        )

    # -- forward --------------------------------------------------------------------------

    @property
    def _dp_size(self) -> int:
        return dist.get_world_size(self._dp_group) if self._dp_group is not None else 1

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.bf16 and not self.distributed:  # FSDP's MixedPrecisionPolicy casts instead
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _micro_forward(self, batch: Batch | None) -> RaggedField | torch.Tensor:
        """Per-response-token log-probs (or values) of one micro-batch.

        `None` runs a one-token pass whose zero output keeps FSDP's collectives in step
        with ranks that have more micro-batches; it returns a zero scalar with a graph.
        """
        if batch is None:
            ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            with self._autocast():
                out = self._model_out(ids, torch.ones_like(ids))
            return out.float().sum() * 0.0
        ids, mask, targets = padded_inputs(batch)
        ids, mask, targets = ids.to(self.device), mask.to(self.device), targets.to(self.device)
        with self._autocast():
            out = self._model_out(ids, mask)
        if self.options.value_head:
            values = out[:, :-1][targets].float()  # [response_tokens]
        else:
            logits = out[:, :-1][targets].float()  # [response_tokens, vocab]
            picked = logits.gather(-1, ids[:, 1:][targets][:, None]).squeeze(-1)
            values = picked - torch.logsumexp(logits, dim=-1)
        offsets = batch.ragged("response_ids").offsets
        return RaggedField(values=values, offsets=offsets.to(values.device))

    def _model_out(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.options.value_head:
            return self.model(input_ids=ids, attention_mask=mask)
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def _micro_batches(self, batch: Batch) -> list[list[int]]:
        lengths = batch.token_count().tolist()
        return agree_micro_batches(
            lengths, self.optim.micro_batch_tokens, self._dp_group, self._collective_device
        )

    @property
    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _forward_no_grad(self, batch: Batch) -> RaggedField:
        self.model.eval()
        pieces: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for micro in self._micro_batches(batch):
                out = self._micro_forward(batch.select(micro) if micro else None)
                if micro:
                    for index, row in zip(micro, out.rows(), strict=True):
                        pieces[index] = row.cpu()
        return RaggedField.from_tensors(
            [pieces[i] for i in range(len(batch))], dtype=torch.float32
        )

    def forward_logprobs(self, batch: Batch) -> RaggedField:
        """Log-probs (temperature 1, float32, no grad) of every response token.

        Collective over the engine's dp group: every rank calls it (with its own samples).
        """
        if self.options.value_head:
            raise RuntimeError(
                "this fsdp engine was built as a critic (value_head: true); use "
                "forward_values, or build another fsdp engine for log-probs."
            )
        return self._forward_no_grad(batch)

    def forward_values(self, batch: Batch) -> RaggedField:
        """Per-response-token values (float32, no grad); needs `value_head: true`."""
        if not self.options.value_head:
            raise RuntimeError(
                "forward_values needs an fsdp engine built with `trainer.fsdp.value_head: "
                "true` (the critic role)."
            )
        return self._forward_no_grad(batch)

    # -- training -------------------------------------------------------------------------

    def _global_counts(self, batch: Batch) -> tuple[int, int]:
        counts = torch.tensor(
            [int(batch.lengths("response_ids").sum()) if len(batch) else 0, len(batch)],
            dtype=torch.int64,
            device=self._collective_device,
        )
        if self._dp_group is not None:
            dist.all_reduce(counts, group=self._dp_group)
        return int(counts[0]), int(counts[1])

    def _set_grad_sync(self, enabled: bool) -> None:
        if self.distributed:
            self.model.set_requires_gradient_sync(enabled)

    def train_step(self, batch: Batch, loss: LossFunction) -> dict[str, float]:
        """Runs `optim.mini_batches` AdamW steps on this dp-rank's samples.

        Collective over the engine group. Each mini-batch is a contiguous slice of the
        batch; its micro-batches' gradients are summed (the loss normalises by the global
        counts it is given) and summed across dp-ranks, then clipped by the global norm.

        Returns:
            The loss's own metrics averaged over this rank's micro-batches, plus `loss`
            (the summed mini-batch loss, averaged over mini-batches), `grad_norm`
            (pre-clip, global) and `lr`.
        """
        self.model.train()
        minis = [c.tolist() for c in torch.arange(len(batch)).tensor_split(self.optim.mini_batches)]
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        totals = {"loss": 0.0, "grad_norm": 0.0}
        for mini in minis:
            sub = batch.select(mini)
            global_tokens, global_samples = self._global_counts(sub)
            micros = self._micro_batches(sub)
            self.optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0
            for k, micro in enumerate(micros):
                self._set_grad_sync(k == len(micros) - 1)
                if not micro:
                    self._micro_forward(None).backward()
                    continue
                part = self._on_device(sub.select(micro))
                out = self._micro_forward(part)
                value, metrics = loss(
                    out, part, global_tokens=global_tokens, global_samples=global_samples
                )
                # FSDP averages gradients over dp; the loss is already globally normalised,
                # so scale by the dp size to obtain the sum.
                (value * self._dp_size).backward()
                mini_loss += float(value.detach())
                for key, v in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(v)
                    counts[key] = counts.get(key, 0) + 1
            totals["grad_norm"] += clip_grad_norm(self.model.parameters(), self.optim.grad_clip)
            self.optimizer.step()
            totals["loss"] += self._dp_sum(mini_loss)
        self.version += 1
        out_metrics = {key: sums[key] / counts[key] for key in sums}
        out_metrics.update({k: v / len(minis) for k, v in totals.items()})
        out_metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        return out_metrics

    def _on_device(self, batch: Batch) -> Batch:
        """The micro-batch with its tensor fields on the engine's device (for the loss)."""
        if self.device.type == "cpu":
            return batch
        fields: dict[str, Any] = {}
        for name, column in batch.fields.items():
            if isinstance(column, RaggedField):
                fields[name] = RaggedField(values=column.values.to(self.device),
                                           offsets=column.offsets.to(self.device))
            elif isinstance(column, torch.Tensor):
                fields[name] = column.to(self.device)
            else:
                fields[name] = column
        return Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                     weight_version=batch.weight_version, fields=fields)

    def _dp_sum(self, value: float) -> float:
        if self._dp_group is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(t, group=self._dp_group)
        return float(t.item())

    # -- weights and checkpoints ----------------------------------------------------------

    def _named_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters())

    def weight_sources(self) -> list[ShardSpec]:
        """This rank's local shard of every parameter (tied parameters once)."""
        specs, _ = named_shard_specs(self._named_params(), self._coords, self._sizes)
        return specs

    @contextlib.contextmanager
    def materialize(self, specs: Sequence[ShardSpec]) -> Iterator[list[torch.Tensor]]:
        """Yields the live local shards of `specs` (no copy, no collective)."""
        params = dict(self._named_params())
        tensors = []
        for spec in specs:
            if spec.local_name not in params:
                raise KeyError(
                    f"fsdp engine has no parameter {spec.local_name!r}; materialize takes "
                    "specs returned by weight_sources()."
                )
            tensors.append(local_box(params[spec.local_name])[1].detach())
        yield tensors

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
            extra={"version": self.version, "layout": self.context.layout.describe()},
        )
        if self.distributed:
            dist.barrier(group=self.context.process_group)

    def load_checkpoint(self, directory: str) -> None:
        """Restores what `save_checkpoint` wrote, onto this engine's layout."""
        rank, world = self._group_rank()
        meta = ckpt.load_shards(
            directory,
            rank=rank,
            world_size=world,
            params=self._named_params(),
            optimizer=self.optimizer,
        )
        self.version = int(meta.get("version", 0))

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
        self.optimizer = None
        self.model = None
