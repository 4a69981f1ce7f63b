"""`minimal`: a complete rollout engine, the worked example of CONTRIBUTING.md.

A transformers model sampled one token at a time (no KV cache, so slow: an example, not
an engine to train with), the whole model on every rank, weights copied in place. It
implements the whole `peerflow.engines.RolloutEngine` contract — log-probs of the
sampling distribution, EOS and stop tokens, seeded reproducibility without touching
torch's global RNG, in-place weight loading — and refuses what it cannot do (top-p,
top-k, stop strings) instead of sampling something else. `peerflow conformance minimal`
passes layers 0–3 with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from peerflow import (
    Capabilities,
    GenerationResult,
    RankCoords,
    RolloutEngine,
    ShardSpec,
    hf_layout,
)
from peerflow.engines import EngineContext, GenerationRequest, SamplingParams
from peerflow.errors import ConfigError


def eos_ids(model_path: str, model: Any) -> set[int]:
    """Every end-of-sequence id: generation config, model config and tokenizer (lists too)."""
    sources: list[Any] = [model.generation_config, model.config]
    try:
        from transformers import AutoTokenizer

        sources.append(AutoTokenizer.from_pretrained(model_path))
    except (OSError, ValueError):  # a checkpoint without a tokenizer
        pass
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        ids.update([] if value is None else value if isinstance(value, list | tuple) else [value])
    return {int(i) for i in ids}


def truncation_refusals(sampling: SamplingParams) -> list[str]:
    """The truncation settings `minimal` cannot honour, one message each (`[]`: none)."""
    return [f"rollout.sampling.{key}={value}: rollout.backend=minimal samples from the full "
            f"tempered distribution; set rollout.sampling.{key}={off} (or pick a backend "
            "that truncates, e.g. hf)."
            for key, value, off in (("top_p", sampling.top_p, 1.0), ("top_k", sampling.top_k, 0))
            if value != off]


class MinimalRollout(RolloutEngine):
    """The whole HF model on every rank; log-probs are `log_softmax(logits / T)`.

    Args:
        context: Where and what to load (`model_path`, `dtype`, `device`, `seed`, `layout`,
            `rank`).
        options: Unused (`NoOptions`): the engine has no options of its own.
    """

    name = "minimal"
    capabilities = Capabilities(logprobs=True, in_place_weight_update=True, reasons={
        "stop_strings": "the minimal example engine samples token ids only",
        "tensor_parallel": "the minimal example engine holds the whole model on every rank"})

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Refuses, before any process starts, the truncation `minimal` cannot do.

        No `Capabilities` flag covers top-p/top-k; `stop` needs the `stop_strings` flag,
        which the engine leaves `False`, so `config validate` refuses it already.
        """
        return truncation_refusals(config.rollout.sampling)

    def __init__(self, context: EngineContext, options: object | None = None) -> None:
        super().__init__(context, options)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            context.model_path, dtype=getattr(torch, context.dtype)).to(context.device).eval()
        self.eos = eos_ids(context.model_path, self.model)
        # The engine's own stream, one per dp replica (tp/pp peers would sample alike):
        # torch's global RNG belongs to the trainer and is never touched here.
        replica = RankCoords.of(context.layout, context.rank).dp_rank
        self.generator = torch.Generator().manual_seed(context.seed + replica)

    def generate(self, requests: Sequence[GenerationRequest],
                 sampling: SamplingParams) -> list[GenerationResult]:
        """Samples `sampling.n` answers per request, grouped by request in request order.

        Raises:
            ConfigError: `top_p`, `top_k` or `stop` is set (the engine cannot honour them).
        """
        problems = truncation_refusals(sampling) + ([
            f"rollout.sampling.stop={list(sampling.stop)}: "
            f"{self.capabilities.reasons['stop_strings']}; remove the stop strings."]
            if sampling.stop else [])
        if problems:  # callers that bypass `config validate` (benchmarks, conformance)
            raise ConfigError(" ".join(problems))
        generator = self.generator if sampling.seed is None else \
            torch.Generator().manual_seed(sampling.seed)
        return [self._sample(request, index, sampling, generator)
                for request in requests for index in range(sampling.n)]

    def _sample(self, request: GenerationRequest, index: int, sampling: SamplingParams,
                generator: torch.Generator) -> GenerationResult:
        """Samples one answer token by token."""
        ids, logprobs, reason = list(request.prompt_ids), [], "length"
        temperature = sampling.temperature or 1.0  # greedy reports log_softmax(logits)
        for _ in range(sampling.max_tokens):
            with torch.no_grad():
                logits = self.model(torch.tensor([ids], device=self.context.device)).logits
            logp = torch.log_softmax(logits[0, -1].float() / temperature, dim=-1).cpu()
            token = int(logp.argmax()) if sampling.temperature == 0 else \
                int(torch.multinomial(logp.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token in self.eos or token in sampling.stop_token_ids:
                reason = "stop"
                break
        return GenerationResult(
            request_id=request.request_id, index=index, finish_reason=reason,
            token_ids=ids[len(request.prompt_ids):],
            logprobs=logprobs if sampling.logprobs else (),
            version_segments=((0, self.weight_version),))

    def weight_targets(self) -> list[ShardSpec]:
        """The HF tensors this rank holds (all of them), as `shard_layout` describes them."""
        return self.shard_layout(self.model.config, self.context.layout, self.context.rank,
                                 self.context.dtype)

    def load_weights(self, items: Sequence[tuple[ShardSpec, torch.Tensor]]) -> None:
        """Copies each bucket's tensors into the model's own parameters."""
        with torch.no_grad():
            for spec, tensor in items:
                self.model.get_parameter(spec.local_name).copy_(tensor)

    @classmethod
    def shard_layout(cls, hf_config: Any, layout: Any, rank: int,
                     dtype: str = "float32") -> list[ShardSpec]:
        """What rank `rank` of `layout` holds: whole HF tensors, replica = its dp index."""
        return hf_layout(hf_config, RankCoords.of(layout, rank), dtype=dtype)

    @classmethod
    def conformance_families(cls) -> tuple[str, ...]:
        """The HF `model_type`s the conformance suite checks."""
        return ("llama", "qwen2", "qwen3")

    @classmethod
    def conformance_read_weights(cls, engine: MinimalRollout) -> dict[str, torch.Tensor]:
        """The model's own tensors by name, read around `load_weights`."""
        return dict(engine.model.named_parameters())
