"""`hf`: the reference rollout engine, built on Hugging Face transformers.

The engine PeerFlow runs by default (the CPU quickstart): one full copy of the model per
rank, all prompts × n samples decoded together in one batched loop under
`torch.inference_mode()` (`peerflow.adapters.hf.decode`: each prompt prefilled once,
finished rows dropped as they go).

Log-probs follow the `RolloutEngine.generate` contract: `log_softmax(logits / T)` at the
sampled token, before top-k/top-p truncation (see `peerflow.adapters.hf.sampling`).

Randomness: with `SamplingParams.seed` a call is reproducible on its own (the runtime
passes a per-step seed, so resumed runs sample the same answers); without it the engine
draws from its own generator, seeded from `EngineContext.seed` and the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from peerflow.adapters.hf.decode import Decoding, Row, decode
from peerflow.adapters.hf.routes import GenerationRoutes
from peerflow.adapters.hf.stops import StopStringMatcher
from peerflow.capabilities import Capabilities
from peerflow.engines import (
    EngineContext,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
)
from peerflow.errors import ConfigError
from peerflow.models.packed_experts import as_declared, canonical_specs
from peerflow.shard import ShardSpec
from peerflow.training import lora


@attrs.frozen(kw_only=True)
class HFRolloutOptions:
    """Options of the `hf` rollout engine (`rollout.hf: {...}`)."""

    max_batch_size: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Most sequences decoded together (prompts × n); 0 decodes everything in one batch.
    Rows are sorted by prompt length before they are split, so batches pad little."""
    include_stop_str_in_output: bool = False
    """Keep the tokens that spell a matched stop string (vLLM's option of the same name)."""
    attn_implementation: str | None = None
    """transformers attention backend (`sdpa`, `eager`); `None` lets transformers pick."""


def torch_dtype(name: str) -> torch.dtype:
    """Returns the torch dtype called `name` (`float32`, `bfloat16`, `float16`)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(
            f"EngineContext.dtype={name!r} is not a torch floating-point dtype; use "
            "float32, bfloat16 or float16."
        )
    return dtype


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


class HFRolloutEngine(RolloutEngine):
    """Batched sampling with a KV cache on a transformers causal LM.

    Holds full Hugging Face tensors (one replica per rank, no tensor parallelism), so its
    weight targets are plain HF names and shapes, and a sync copies into the live
    parameters in place.
    """

    name: ClassVar[str] = "hf"
    capabilities: ClassVar[Capabilities] = Capabilities(
        logprobs=True, stop_strings=True, in_place_weight_update=True, lora=True,
        routed_experts=True,
        reasons={"tensor_parallel": "the hf engine holds a full model per rank; use vllm or "
                                    "sglang for tensor-parallel inference"})
    options_class: ClassVar[type] = HFRolloutOptions

    def __init__(self, context: EngineContext, options: HFRolloutOptions | None = None) -> None:
        super().__init__(context, options if options is not None else HFRolloutOptions())
        from transformers import AutoModelForCausalLM

        layout = context.layout
        if layout.tp > 1 or layout.pp > 1:
            raise ConfigError(
                f"rollout.backend 'hf' holds a full model per rank but the layout is "
                f"{layout.describe()}; set rollout.layout.tp and pp to 1 (use vllm or "
                "sglang for tensor parallel inference)."
            )
        kwargs: dict[str, Any] = {"dtype": torch_dtype(context.dtype)}
        if self.options.attn_implementation:
            kwargs["attn_implementation"] = self.options.attn_implementation
        self.device = context.device
        model = AutoModelForCausalLM.from_pretrained(context.model_path, **kwargs)
        self._routes = GenerationRoutes(model)  # MoE: every token's experts, recorded
        self.model, self._params = lora.rollout_model(  # with trainer.lora: peft's adapters
            model, context.lora)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = self._load_tokenizer(context.model_path)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_token_id = int(
            pad if pad is not None else min(self.eos_token_ids, default=0)
        )
        self._generator = torch.Generator(self.device).manual_seed(
            context.seed * 1_000_003 + context.rank
        )

    @staticmethod
    def _load_tokenizer(path: str) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            return None  # token-id-only use works; stop strings then raise a clear error

    # -- sampling -------------------------------------------------------------------------

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Samples `sampling.n` answers per request in batched decode loops.

        See `RolloutEngine.generate`. With `sampling.seed` set, the same requests and
        seed give the same answers; otherwise draws come from the engine's own stream
        (seeded from `EngineContext.seed` and the rank).
        """
        self._check_sampling(requests, sampling)
        rows = [
            Row(request_index=i, sample_index=j, prompt=req.prompt_ids)
            for i, req in enumerate(requests)
            for j in range(sampling.n)
        ]
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)
        matcher = StopStringMatcher(self.tokenizer, sampling.stop) if sampling.stop else None
        stop_ids = self.eos_token_ids | set(sampling.stop_token_ids)
        order = sorted(range(len(rows)), key=lambda k: len(rows[k].prompt))
        size = self.options.max_batch_size or len(rows) or 1
        with torch.inference_mode():
            for start in range(0, len(order), size):
                chunk = [rows[k] for k in order[start : start + size]]
                decode(self.model, chunk, Decoding(
                    sampling=sampling, generator=generator, stop_ids=stop_ids, matcher=matcher,
                    pad_token_id=self.pad_token_id, device=self.device, routes=self._routes))
        return [self._result(row, requests, sampling, matcher) for row in rows]

    def _check_sampling(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> None:
        if sampling.n < 1 or sampling.max_tokens < 1:
            raise ValueError(
                f"SamplingParams n={sampling.n}, max_tokens={sampling.max_tokens}: both must "
                "be at least 1."
            )
        if not 0.0 < sampling.top_p <= 1.0 or sampling.top_k < 0 or sampling.temperature < 0:
            raise ValueError(
                f"SamplingParams temperature={sampling.temperature}, top_p={sampling.top_p}, "
                f"top_k={sampling.top_k}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0."
            )
        if sampling.stop and self.tokenizer is None:
            raise ConfigError(
                f"SamplingParams.stop={sampling.stop!r} needs a tokenizer, but none loads from "
                f"{self.context.model_path!r}; save one there (tokenizer.save_pretrained) or "
                "use stop_token_ids."
            )
        limit = getattr(self.model.config, "max_position_embeddings", None)
        for req in requests:
            if not req.prompt_ids:
                raise ValueError(
                    f"GenerationRequest {req.request_id} has no prompt tokens; every prompt "
                    "needs at least one token."
                )
            if limit is not None and len(req.prompt_ids) + sampling.max_tokens > limit:
                raise ValueError(
                    f"GenerationRequest {req.request_id}: {len(req.prompt_ids)} prompt tokens + "
                    f"max_tokens={sampling.max_tokens} exceed the model's "
                    f"max_position_embeddings={limit}; shorten the prompt or lower max_tokens."
                )

    def _result(
        self,
        row: Row,
        requests: Sequence[GenerationRequest],
        sampling: SamplingParams,
        matcher: StopStringMatcher | None,
    ) -> GenerationResult:
        keep = len(row.tokens)
        if row.stopped_on_string and matcher is not None:
            keep = matcher.cut(row.tokens, self.options.include_stop_str_in_output)
        return GenerationResult(
            request_id=requests[row.request_index].request_id,
            index=row.sample_index,
            token_ids=row.tokens[:keep],
            logprobs=row.logprobs[:keep] if sampling.logprobs else (),
            finish_reason=row.finish_reason,
            version_segments=((0, self.weight_version),),
            routed_experts=self._routes.result(row, keep),
        )

    # -- weights --------------------------------------------------------------------------

    def weight_targets(self) -> list[ShardSpec]:
        """Every parameter as one full HF tensor.

        Tied parameters appear once, under their first name (`model.embed_tokens.weight`
        when `tie_word_embeddings`; `lm_head.weight` is then not listed). Every dp-rank
        holds a full copy; the replica index is the dp-rank.
        """
        layout = self.context.layout
        replica = layout.coord(self.context.rank).dp if self.context.rank in \
            layout.global_ranks else 0
        return canonical_specs(self.model.config, [  # MoE experts one by one
            ShardSpec.of_slice(name, tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."),
                               replica=replica)
            for name, p in self._params.items()
        ])

    def _param(self, spec: ShardSpec) -> torch.Tensor:
        param = self._params.get(spec.local_name)
        if param is None:
            raise KeyError(
                f"hf engine has no parameter {spec.local_name!r}; weight syncs take the specs "
                f"of weight_targets() (e.g. {next(iter(self._params), '')!r})."
            )
        return param

    def weight_buffers(self, specs: Sequence[ShardSpec]) -> list[torch.Tensor]:
        """The live parameters of `specs`, so a sync writes into them without staging."""
        return [as_declared(self._param(spec).data, spec) for spec in specs]

    def load_weights(self, items: Sequence[tuple[ShardSpec, torch.Tensor]]) -> None:
        """Copies each tensor into the live parameter of the same name (dtype converted).

        A tensor that already is the parameter (from `weight_buffers`) is left as is.
        """
        with torch.no_grad():
            for spec, tensor in items:
                param = as_declared(self._param(spec).data, spec)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"hf engine: tensor for {spec.local_name!r} has shape "
                        f"{tuple(tensor.shape)}, expected {tuple(param.shape)}."
                    )
                if tensor.data_ptr() != param.data_ptr():
                    param.copy_(tensor)

    # -- conformance hooks (read by peerflow.conformance; see its profile module) ---------

    @classmethod
    def shard_layout(cls, hf_config: Any, layout: Any, rank: int,
                     dtype: str = "float32") -> list[ShardSpec]:
        """What `weight_targets()` returns on `rank` of `layout`: every HF tensor, whole.

        MoE families list transformers' packed experts by the canonical tensors of their
        2-D views (`peerflow.models.packed_experts`).

        Raises:
            ConfigError: The layout has tp/pp/ep > 1, or the family has no layout here.
        """
        from peerflow.models import ModelShape, hf_layout

        if layout.tp > 1 or layout.pp > 1 or layout.ep > 1:
            raise ConfigError(
                f"the hf engine holds a full model per rank; layout {layout.describe()} is "
                "refused (use vllm or sglang for tensor-parallel inference)."
            )
        family = ModelShape.from_hf_config(hf_config).family
        if family not in cls.conformance_families():
            raise ConfigError(
                f"the hf engine's declared layout covers {cls.conformance_families()}; model "
                f"family {family!r} has no layout family in peerflow.models."
            )
        return hf_layout(hf_config, replica=layout.coord(rank).dp, dtype=dtype,
                         packed_experts=True)

    @classmethod
    def conformance_families(cls) -> tuple[str, ...]:
        """Model families whose modules' tensors map onto canonical HF tensors."""
        return ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")

    @classmethod
    def conformance_read_weights(cls, engine: HFRolloutEngine) -> dict[str, torch.Tensor]:
        """Copies of the parameters, read from the module (bypassing `load_weights`).

        Copies or live tensors both work: the suite clones what it keeps.
        """
        return {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    @classmethod
    def conformance_scribble(cls, engine: HFRolloutEngine) -> None:
        """Overwrites every live parameter with a constant."""
        with torch.no_grad():
            for param in engine.model.parameters():
                param.fill_(-7.0)

    def shutdown(self) -> None:
        """Drops the model so its memory can be freed. Safe to call twice."""
        self._params = {}
        self.model = None
