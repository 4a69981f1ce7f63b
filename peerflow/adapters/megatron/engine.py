"""`MegatronTrainEngine`: Megatron-core `GPTModel` with tensor and pipeline parallelism.

The model is built from the HF config (`model.py`), HF weights are imported shard by
shard into Megatron's layout (`weights.py`, driven by `peerflow.models.megatron_layout`),
and the same specs describe the local shards for weight export, so the resharder moves
Megatron shards straight to rollout shards (interleaved QKV per query group, fused gate/up
`linear_fc1`, padded vocab-parallel embedding).

Forward and backward always go through Megatron's pipeline schedules (`pipeline.py`:
`get_forward_backward_func`, no pipelining with pp=1, 1F1B with pp>1) on micro-batches of
one shape per mini-batch. Log-probs at the sampling temperature come from the
vocab-parallel logits through the training toolkit (`peerflow.training.VocabShard`; the
padded vocabulary rows are masked out first), which also owns mini-batches, global
counts and metrics; this module supplies the model, the weights and the step.

Gradients: Megatron's DDP wrapper reduces them over dp (summed: the PeerFlow loss is
already normalised by the global token count, `calculate_per_token_loss=True`) and
all-reduces the tied embedding between the first and last stage. On GPU
`use_distributed_optimizer` selects Megatron's distributed optimizer; on CPU a
`torch.optim.AdamW` steps Megatron's gradient buffers (`cpu.py` has the CUDA redirects).

MoE models (Qwen3-MoE, Mixtral) build Megatron's MoE layer with experts split over
`trainer.layout.ep` (`parallel.py` says how PeerFlow's ep peers map onto Megatron's
groups); their routers run under the toolkit's routing-replay controller through
megatron-core's `moe_enable_routing_replay` hook (`routing.py`, docs/moe.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from peerflow.adapters.megatron.checkpoint import MegatronCheckpoints
from peerflow.adapters.megatron.cpu import needs_redirects, tensor_cuda_is_identity
from peerflow.adapters.megatron.layout import (
    check_moe_layout,
    family_problems,
    megatron_shard_layout,
)
from peerflow.adapters.megatron.model import (
    MOE_FAMILIES,
    SUPPORTED_FAMILIES,
    build_gpt_model,
    check_supported,
    mirror_padding_idx,
    transformer_config,
)
from peerflow.adapters.megatron.optim import (
    build_lr_schedulers,
    build_optimizer,
    clip_and_step,
    param_dtype,
)
from peerflow.adapters.megatron.options import MegatronOptions
from peerflow.adapters.megatron.parallel import (
    clip_group,
    dp_group_and_rank,
    ensure_distributed,
    init_parallel_state,
)
from peerflow.adapters.megatron.pipeline import MegatronPipeline, finalize_without_token_scaling
from peerflow.adapters.megatron.routing import TokenOrder, hook_routers, release_routers
from peerflow.adapters.megatron.weights import covered_names, import_hf_weights
from peerflow.capabilities import Capabilities
from peerflow.distributed.ranklog import say_in_rank_log
from peerflow.engines import EngineContext, OptimSettings
from peerflow.engines.train import tensors_of, yield_tensors
from peerflow.errors import ConfigError, ShardError
from peerflow.models.safetensors_reader import SafetensorsReader
from peerflow.shard import ShardSpec
from peerflow.training import (
    CausalLMTrainEngine,
    VocabShard,
    check_layout_spans_world,
)


def _say_padding(optim: OptimSettings) -> None:
    """Says in the rank log that megatron pads, whatever `trainer.padding_free` says.

    `trainer.padding_free: true` and `trainer.activation_checkpointing` are refused at
    `config validate` (`Capabilities.reasons` of this engine).
    """
    say_in_rank_log(f"megatron: padded micro-batches of one shape (trainer.padding_free="
        f"{str(optim.padding_free).lower()} applies to fsdp and deepspeed only).")


class MegatronTrainEngine(MegatronCheckpoints, MegatronPipeline, CausalLMTrainEngine):
    """Train engine backed by Megatron-core `GPTModel` (TP, PP, DP from the layout)."""

    name = "megatron"
    capabilities = Capabilities(
        tensor_parallel=True, pipeline_parallel=True, checkpoint=True, expert_parallel=True,
        routing_replay=True,
        reasons={
            "lora": "megatron-core 0.16 has no LoRA of its own and no maintained library "
                    "here adds one (NVIDIA's Megatron-Bridge PEFT needs megatron-core >= "
                    "0.17, Python >= 3.12 and CUDA)",
            "padding_free": "the megatron trainer runs padded micro-batches of one shape "
                            "(its pipeline schedules exchange fixed-shape activations; "
                            "Megatron's packed THD path needs Transformer Engine)",
            "activation_checkpointing": "the megatron trainer does not wire up Megatron's "
                                        "activation recompute",
        })
    options_class = MegatronOptions
    requires = ("megatron.core",)
    install_hint = "pip install 'peerflow[megatron]' (megatron-core>=0.16.1)"

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """A model family or MoE layout Megatron cannot build; a split placement."""
        problems = family_problems(config.model.model_type(), config.trainer.layout)
        if config.runtime.placement == "split":
            problems.append(
                "runtime.placement=split: trainer.backend=megatron must span every process "
                "(Megatron's parallel state is global), and a split placement gives the "
                "rollout ranks of their own (so runtime.mode=async cannot run on megatron). "
                "Fix: runtime.placement: colocated with runtime.mode: sync, or "
                "trainer.backend fsdp or deepspeed.")
        return problems

    def __init__(self, context: EngineContext, options: MegatronOptions | None,
                 optim: OptimSettings) -> None:
        options = options or MegatronOptions()
        super().__init__(context, options, optim)
        self.ensure_installed()
        _say_padding(optim)
        from transformers import AutoConfig

        layout = context.layout
        if layout.cp != 1:
            raise ConfigError(
                f"trainer.backend=megatron got layout {layout.describe()}; context "
                "parallelism is not wired up; set trainer.layout.cp: 1."
            )
        on_gpu = context.device.type == "cuda"
        if options.use_distributed_optimizer and not on_gpu:
            raise ConfigError(
                "trainer.megatron.use_distributed_optimizer=true needs a CUDA device "
                "(megatron-core's optimizers only accept CUDA tensors); set it to false on CPU."
            )
        ensure_distributed(context)
        check_layout_spans_world(layout, backend="megatron",
                                 why="Megatron's parallel state is global",
                                 fix="make dp*tp*pp*ep equal the world size")
        self.hf_config = AutoConfig.from_pretrained(context.model_path)
        self.shape = check_supported(self.hf_config)
        check_moe_layout(self.shape, layout)
        ps = init_parallel_state(context)
        self.ps = ps
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.dp_group, self.dp_rank = dp_group_and_rank(ps)
        self.device = context.device
        self.dtype = dtype = param_dtype(self.optim.bf16, optim.bf16, options, context.dtype)
        layout.check_divides("query groups (num_key_value_heads)", self.shape.num_kv_heads)
        layout.check_divides("layers", self.shape.num_layers, dim="pp")
        self.config = transformer_config(self.hf_config, tp=layout.tp, pp=layout.pp, ep=layout.ep,
                                         dtype=dtype, on_cpu=not on_gpu)
        self.is_first = ps.is_pipeline_first_stage()
        self.is_last_stage = ps.is_pipeline_last_stage()
        with tensor_cuda_is_identity(needs_redirects(context.device)):
            model = build_gpt_model(self.hf_config, self.config, tp=layout.tp,
                                    vocab_multiple=options.vocab_multiple,
                                    pre_process=self.is_first, post_process=self.is_last_stage)
        model.to(self.device)
        mirror_padding_idx(model, self.hf_config)
        self._order = TokenOrder()
        self._attach_megatron_routing(model)
        self._specs = self._layout_specs()
        params = dict(model.named_parameters())
        if set(params) != covered_names(self._specs):
            raise ShardError(
                f"GPTModel parameters and the Megatron layout disagree: only in the model "
                f"{sorted(set(params) - covered_names(self._specs))[:4]}, only in the layout "
                f"{sorted(covered_names(self._specs) - set(params))[:4]}."
            )
        import_hf_weights(params, self._specs, SafetensorsReader(context.model_path))
        self.module = model
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=options.grad_reduce_in_fp32,
            overlap_grad_reduce=options.overlap_grad_reduce and on_gpu,
            use_distributed_optimizer=options.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config,
                                             module=model)
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = finalize_without_token_scaling
        self.optimizer = build_optimizer(self.model, self.module, optim, dtype=dtype,
                                         distributed=options.use_distributed_optimizer)
        self.lr_schedulers = build_lr_schedulers(self.optimizer, optim)
        self.vocab_local = model.output_layer.weight.shape[0] if self.is_last_stage and \
            model.output_layer.weight is not None else None
        if self.is_last_stage and self.vocab_local is None:
            self.vocab_local = model.shared_embedding_or_output_weight().shape[0]

    # ------------------------------------------------------------------ setup
    def _attach_megatron_routing(self, model: Any) -> None:
        """The one routing-replay controller over Megatron's routers (`routing.py`).

        A dense model goes through `attach_routing`, which refuses `r2`/`r3` for it.
        """
        if not self.shape.num_experts:
            self.attach_routing(model)
            return
        from peerflow.training.routing_replay import RoutingReplay

        self.routing = RoutingReplay.hooked(
            self.optim.routing_replay, num_layers=self.shape.num_layers,
            top_k=int(self.config.moe_router_topk), num_experts=self.shape.num_experts,
            sparse_layers=self.shape.sparse_layers)
        hook_routers(model, self.routing, self._order, self.config)

    def _layout_specs(self) -> list[ShardSpec]:
        import torch.distributed as dist

        specs = megatron_shard_layout(self.hf_config, self.context.layout, dist.get_rank(),
                                      vocab_multiple=self.options.vocab_multiple,
                                      dtype=str(self.dtype).removeprefix("torch."))
        coord = self.context.layout.coord(dist.get_rank())
        mine = (self.tp_rank, self.pp_rank, self.dp_rank, self.ep_rank)
        if (coord.tp, coord.pp, coord.dp, coord.ep) != mine:
            raise ConfigError(
                f"Megatron placed rank {dist.get_rank()} at tp={self.tp_rank} pp={self.pp_rank} "
                f"dp={self.dp_rank} ep={self.ep_rank} but the layout says {coord}; the rank "
                "orders disagree."
            )
        return specs

    # ------------------------------------------------- what the toolkit needs
    def vocab_shard(self) -> VocabShard:
        """This tp rank's slice of the vocab-parallel output layer (padded rows masked)."""
        return VocabShard(group=self.ps.get_tensor_model_parallel_group(),
                          start=self.tp_rank * self.vocab_local,
                          vocab_size=self.shape.vocab_size)

    def zero_grad(self) -> None:
        """Clears Megatron's gradient buffers and the optimiser's gradients."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Clip over the model-parallel group, step, and step the lr schedule (`optim.py`)."""
        norm = clip_and_step(self.optimizer, self.module, self.optim.grad_clip,
                             tp_rank=self.tp_rank, ep_rank=self.ep_rank,
                             group=clip_group(self.ps, self.context.layout.ep))
        for sched in self.lr_schedulers:
            sched.step()
        return norm

    def current_lr(self) -> float:
        """The learning rate of the optimiser's first param group."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_training(self, mode: bool) -> None:
        """`model.train(mode)`."""
        self.model.train(mode)

    # --------------------------------------------------------------- contract
    def weight_sources(self) -> list[ShardSpec]:
        """This rank's Megatron tensors as pieces of HF tensors (see `megatron_layout`)."""
        return list(self._specs)

    def materialize(
        self, specs: Sequence[ShardSpec]
    ) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Yields this rank's local tensors for `specs` (no gather: shards are plain)."""
        params = tensors_of(specs, dict(self.module.named_parameters()), self.name)
        return yield_tensors([param.detach() for param in params])

    # ------------------------------------------------------- conformance hooks
    shard_layout = staticmethod(megatron_shard_layout)

    @classmethod
    def conformance_layouts(cls) -> list[Any]:
        """TP 1/2 × PP 1/2, dp 2, and ep 2 (MoE models; dense ones refuse it)."""
        from peerflow.layout import ParallelLayout

        return [ParallelLayout(), ParallelLayout(tp=2), ParallelLayout(pp=2),
                ParallelLayout(tp=2, pp=2), ParallelLayout(dp=2), ParallelLayout(ep=2)]

    @classmethod
    def conformance_families(cls) -> tuple[str, ...]:
        """Dense families `GPTModel` mirrors, and the MoE families of Megatron's MoE layer."""
        return SUPPORTED_FAMILIES + MOE_FAMILIES

    @classmethod
    def conformance_read_weights(cls, engine: MegatronTrainEngine) -> dict[str, torch.Tensor]:
        """The live `GPTModel` parameters by Megatron name (bypassing `materialize`)."""
        return {name: p.data for name, p in engine.module.named_parameters()}

    def shutdown(self) -> None:
        """Releases the model and Megatron's parallel state (idempotent)."""
        if getattr(self, "model", None) is None:
            return
        if self.routing is not None:
            release_routers(self.module)
        self.model = self.module = self.optimizer = None
        self.lr_schedulers = []
        with contextlib.suppress(Exception):
            self.ps.destroy_model_parallel()
