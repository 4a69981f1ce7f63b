"""`DeepSpeedTrainEngine`: a Hugging Face causal LM trained with DeepSpeed ZeRO 1/2/3.

Runs over gloo on CPU and NCCL on GPU. The training toolkit (`peerflow.training`) owns
the loss, micro-batching, log-probs at the sampling temperature and gradient accumulation
(DeepSpeed's accumulation boundary is set per micro-batch, so DeepSpeed reduces and steps
once per mini-batch); DeepSpeed owns partitioning, gradient reduction, clipping and the
optimiser step.

Weight export never gathers the whole model on one rank: every HF parameter is one
`ShardSpec` whose *owner* (replica 0) is picked round-robin by size over the dp ranks;
`materialize(specs)` gathers, under ZeRO-3, exactly the parameters of that bucket with
`deepspeed.zero.GatheredParameters` (a collective every rank joins) and only owners send.
Under ZeRO 0/1/2 parameters are replicated and `materialize` is a view.

DeepSpeed is imported inside methods only (see `EngineBase`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from peerflow.adapters.deepspeed.checkpoint import DeepSpeedCheckpoints
from peerflow.adapters.deepspeed.layout import (
    FAMILIES,
    adapter_shard_layout,
    check_layout,
    deepspeed_shard_layout,
)
from peerflow.adapters.deepspeed.loading import load_hf_weights
from peerflow.adapters.deepspeed.options import DeepSpeedOptions
from peerflow.capabilities import Capabilities
from peerflow.engines import EngineContext, OptimSettings
from peerflow.engines.train import tensors_of
from peerflow.errors import ConfigError
from peerflow.models.packed_experts import as_declared
from peerflow.shard import ShardSpec
from peerflow.training import (
    CausalLMTrainEngine,
    MicroBatch,
    build_adamw,
    build_lr_scheduler,
    check_layout_spans_world,
    lora,
    torch_dtype,
)


def _ensure_distributed(context: EngineContext) -> None:
    """Starts DeepSpeed's comm layer on top of torch.distributed (one process if needed)."""
    import deepspeed
    import torch.distributed as dist

    from peerflow.distributed.devices import group_backend

    backend = group_backend(context.device)
    if context.device.type != "cuda":
        _skip_shared_memory_all_reduce()
    # zero.Init reads LOCAL_RANK even when the caller started torch.distributed itself.
    os.environ.setdefault("LOCAL_RANK", str(context.device.index or 0))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def _skip_shared_memory_all_reduce() -> None:
    """Keeps DeepSpeed's CPU comm layer from JIT-compiling its shared-memory all-reduce.

    `deepspeed.comm` builds the `deepspeed_shm_comm` C++ op when it starts on CPU (about
    47 s with a C++ compiler, under a lock in ~/.cache/torch_extensions); only DeepSpeed
    inference's `inference_all_reduce` uses it, and training reduces through gloo.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def _no_init_weights() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()



def _as_2d(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A packed expert tensor's shape as its spec's 2-D view (`[E, R, C]` → `[E * R, C]`).

    GPT-OSS's packed checkpoint tensors are declared whole instead.
    """
    return shape if len(shape) <= 2 else (math.prod(shape[:-1]), shape[-1])


class DeepSpeedTrainEngine(DeepSpeedCheckpoints, CausalLMTrainEngine):
    """Train engine backed by `deepspeed.initialize` (ZeRO stage from the options)."""

    name = "deepspeed"
    capabilities = Capabilities(
        checkpoint=True, lora=True, padding_free=True, activation_checkpointing=True,
        routing_replay=True,
        reasons={"tensor_parallel": "DeepSpeed ZeRO here is data parallel only; use "
                                    "trainer.backend megatron for tensor parallelism",
                 "pipeline_parallel": "DeepSpeed ZeRO here is data parallel only; use "
                                      "trainer.backend megatron for pipeline parallelism"})
    options_class = DeepSpeedOptions
    requires = ("deepspeed",)
    install_hint = (
        "pip install 'peerflow[deepspeed]' (CPU: pip install -c constraints-cpu.txt deepspeed)"
    )

    def __init__(self, context: EngineContext, options: DeepSpeedOptions | None,
                 optim: OptimSettings) -> None:
        options = options or DeepSpeedOptions()
        super().__init__(context, options, optim)
        self.ensure_installed()
        import deepspeed
        import torch._dynamo  # noqa: F401  (must precede zero.Init; see engines-on-cpu notes)
        import torch.distributed as dist
        from transformers import AutoConfig, AutoModelForCausalLM

        layout = context.layout
        check_layout(layout)
        _ensure_distributed(context)
        check_layout_spans_world(layout, backend="deepspeed",
                                 why="ZeRO partitions over the default group",
                                 fix="give the trainer every rank or use trainer.backend=fsdp")
        self.dp_group = dist.group.WORLD
        self.dp_rank = dist.get_rank()
        self.dp_size = dist.get_world_size()
        self.device = context.device
        dtype = torch_dtype(context.dtype)
        bf16 = self.optim.bf16 or dtype == torch.bfloat16
        self.ds_config = options.deepspeed_config(self.optim, bf16=bf16)
        torch.manual_seed(context.seed)

        hf_config = AutoConfig.from_pretrained(context.model_path)
        if options.zero_stage == 3:
            # HF's weight init indexes into parameters (e.g. the padding row of the
            # embedding), which zero.Init has already partitioned away; every weight is
            # read from the checkpoint next, so skip it. No `dtype`: zero.Init then takes
            # it from the config (float32 unless bf16); an explicit dtype is ignored on
            # accelerators without fp16 (DeepSpeed 0.19 picks bfloat16 on CPU).
            with _no_init_weights(), deepspeed.zero.Init(
                    config_dict_or_path=self.ds_config, remote_device=None):
                model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
            model.tie_weights()
            load_hf_weights(model, context.model_path, partitioned=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(context.model_path,
                                                         dtype=torch.float32)
        model = self.prepare_model(model, share_prompts=options.share_prompts)
        model.config.use_cache = False
        self._compute_dtype = torch.bfloat16 if bf16 else torch.float32
        optimizer = build_adamw(model.parameters(), optim)
        # DeepSpeed steps the schedule after each optimiser step and checkpoints its state.
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config,
            lr_scheduler=build_lr_scheduler(optimizer, optim),
        )
        self._specs = deepspeed_shard_layout(hf_config, layout, dist.get_rank())
        if context.lora is not None:
            self._specs = adapter_shard_layout(
                {n: self._full_shape(p) for n, p in self._sync_params().items()}, layout,
                dist.get_rank())
        held = {n: self._full_shape(p) for n, p in self._sync_params().items()}
        declared = {s.local_name: s.local_shape for s in self._specs}
        if held.keys() != declared.keys() or any(  # packed experts: whole or 2-D views
                declared[n] not in (shape, _as_2d(shape)) for n, shape in held.items()):
            raise ConfigError(
                f"{type(model).__name__} parameters differ from the canonical HF tensors of "
                f"its config (only in the model: {sorted(held.keys() - declared.keys())[:3]}, "
                f"only canonical: {sorted(declared.keys() - held.keys())[:3]}); weight export "
                "needs canonical names."
            )

    # ---------------------------------------------------------------- helpers
    @property
    def _module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the engine runs."""
        return self.options.zero_stage

    def _sync_params(self) -> dict[str, torch.nn.Parameter]:
        """The parameters a sync and a checkpoint carry, by name.

        Every one, or with `trainer.lora` the adapters only (under peft's names).
        """
        if self.context.lora is not None:
            return dict(lora.adapter_parameters(self._module))
        return dict(self._module.named_parameters())

    @staticmethod
    def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
        return tuple(getattr(param, "ds_shape", param.shape))

    # ------------------------------------------------- what the toolkit needs
    def forward_micro(self, micro: MicroBatch) -> torch.Tensor:
        """Logits `[R, K, V]` of one micro-batch's last `K = logits_to_keep` positions.

        A row per sample, or per prompt when the samples share it (`shares_prompts`: a 4D
        mask in the dtype the model computes in keeps their answers apart).

        DeepSpeed reduces gradients and steps at the accumulation boundary, which is the
        last micro-batch of a mini-batch.
        """
        self.engine.set_gradient_accumulation_boundary(micro.last)
        inputs = micro.inputs
        return self.engine(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask_as(self._compute_dtype),
            position_ids=inputs.position_ids,
            use_cache=False,
            logits_to_keep=inputs.logits_to_keep,
        ).logits

    def backward_micro(self, loss: torch.Tensor, micro: MicroBatch) -> None:
        """`engine.backward` of `loss` times the dp size.

        DeepSpeed averages gradients over dp ranks; the loss is already normalised by the
        global token count, so the scale turns the average into the sum.
        """
        self.engine.backward(loss * self.dp_size, scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        """DeepSpeed's clip, step and schedule step; returns its global gradient norm."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def current_lr(self) -> float:
        """DeepSpeed's learning rate."""
        return float(self.engine.get_lr()[0])

    def set_training(self, mode: bool) -> None:
        """`engine.train(mode)`."""
        self.engine.train(mode)

    # ---------------------------------------------------------------- contract
    def weight_sources(self) -> list[ShardSpec]:
        """One full-tensor spec per HF parameter; its owner rank sends it (replica 0).

        With `trainer.lora`, one per adapter tensor instead (peft's names).
        """
        return list(self._specs)

    def materialize(
        self, specs: Sequence[ShardSpec]
    ) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Yields the full tensors of `specs`; under ZeRO-3 gathers only those parameters."""
        return self._materialize(specs)

    @contextlib.contextmanager
    def _materialize(self, specs: Sequence[ShardSpec]) -> Iterator[list[torch.Tensor]]:
        chosen = tensors_of(specs, self._sync_params(), self.name)
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(chosen, modifier_rank=None):
                yield [as_declared(p.data.detach(), s) for p, s in zip(chosen, specs,
                                                                       strict=True)]
        else:
            yield [as_declared(p.data.detach(), s) for p, s in zip(chosen, specs, strict=True)]

    # ------------------------------------------------------- conformance hooks
    shard_layout = staticmethod(deepspeed_shard_layout)

    @classmethod
    def conformance_layouts(cls) -> list[Any]:
        """One rank and two dp ranks (ZeRO is data parallel only)."""
        from peerflow.layout import ParallelLayout

        return [ParallelLayout(), ParallelLayout(dp=2)]

    @classmethod
    def conformance_families(cls) -> tuple[str, ...]:
        """Dense families whose HF module names are canonical."""
        return FAMILIES

    @classmethod
    def conformance_engine(cls, model_path: str, *, device: str = "cpu") -> DeepSpeedTrainEngine:
        """A one-rank ZeRO-3 engine, so the suite's export runs the per-bucket gather."""
        from peerflow.layout import ParallelLayout

        context = EngineContext(model_path=model_path, layout=ParallelLayout(), device=device)
        return cls(context, DeepSpeedOptions(zero_stage=3), OptimSettings())

    @classmethod
    def conformance_read_weights(cls, engine: DeepSpeedTrainEngine) -> dict[str, torch.Tensor]:
        """Live parameter storage, read around `materialize`.

        Under ZeRO-3 this is each parameter's own partition (`ds_tensor`), which on the
        suite's single rank holds the whole tensor; under ZeRO 0-2 the module parameters.
        """
        out = {}
        for name, param in engine._module.named_parameters():
            if engine.zero_stage == 3:
                if engine.dp_size != 1:
                    raise RuntimeError("conformance_read_weights reads ZeRO-3 on one rank only")
                out[name] = param.ds_tensor.narrow(0, 0, param.ds_numel).view(param.ds_shape)
            else:
                out[name] = param.data
        return out

    def shutdown(self) -> None:
        """Drops the DeepSpeed engine (idempotent)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
            self.engine = None
