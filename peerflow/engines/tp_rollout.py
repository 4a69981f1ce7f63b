"""Base of rollout engines that drive their own tensor-parallel workers (vLLM, SGLang).

Hosted on one rank per replica (`Capabilities.multiprocess`), such an engine's
`weight_targets()` list every tp worker's shards, prefixed `tp{r}/` when tp > 1
(`peerflow.models.vllm.tp_prefixed_layout`).
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from peerflow.capabilities import Capabilities
from peerflow.engines.base import EngineContext, WeightSyncStats
from peerflow.engines.rollout import (
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    tokens_before_stop,
)
from peerflow.models.vllm import split_tp_prefix, tp_prefixed_layout
from peerflow.shard import ShardSpec


class TensorParallelRolloutEngine(RolloutEngine, abc.ABC):
    """A rollout engine whose tp workers are driven from one rank.

    A subclass starts its engine in `__init__`, then calls `_declare_targets(decode)`;
    in `load_weights` it checks each item with `_check_item` and adds its timings to
    `self._sync` (`pack_s`, `wire_s`, `load_s`, `bytes`, `buckets`); its
    `finish_weight_update` ends with `super().finish_weight_update()`.

    Args:
        context: Where and what to load (`model_path`, `dtype`, `seed`).
        options: The adapter's `options_class` (its defaults when `None`); it has
            `include_stop_str_in_output`.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        logprobs=True, stop_strings=True, tensor_parallel=True, in_place_weight_update=True,
        multiprocess=True)
    """What every such engine supports; an adapter adds its own with `attrs.evolve`."""
    options: Any

    def __init__(self, context: EngineContext, options: object | None = None) -> None:
        super().__init__(context, options if options is not None else self.options_class())
        self.ensure_installed()
        self._sync: Counter[str] = Counter()
        self.last_sync: WeightSyncStats | None = None
        """Time split and bytes of the last completed sync, as the engine measured it."""
        self._targets: list[ShardSpec] = []
        self._by_name: dict[str, ShardSpec] = {}
        self._decode: Callable[[list[int]], str] | None = None

    @property
    @abc.abstractmethod
    def tp_size(self) -> int:
        """Tensor-parallel workers this engine drives."""

    def _declare_targets(self, decode: Callable[[list[int]], str]) -> None:
        """Declares the engine's parameters (HF config of the model) and its detokenizer."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.context.model_path)
        self._targets = tp_prefixed_layout(config, self.tp_size, dtype=self.context.dtype)
        self._by_name = {spec.local_name: spec for spec in self._targets}
        self._decode = decode

    def _answer(self, request: GenerationRequest, index: int, tokens: list[int],
                logprobs: list[float], *, reason: str, stop_text: str | None) -> GenerationResult:
        """Returns one sampled answer as a `GenerationResult` of the live weight version.

        Args:
            request: The request answered.
            index: The answer's index among the request's `n`.
            tokens: The engine's output tokens.
            logprobs: Their log-probs (empty when not asked for).
            reason: The engine's finish reason (anything but `length`/`abort` is `stop`).
            stop_text: The decoded text when a stop string ended the answer: unless the
                options keep it, the answer is cut before the stop string.
        """
        if stop_text is not None and not self.options.include_stop_str_in_output \
                and self._decode is not None:
            keep = tokens_before_stop(self._decode, tokens, stop_text)
            tokens, logprobs = tokens[:keep], logprobs[:keep]
        return GenerationResult(
            request_id=request.request_id, index=index, token_ids=tokens, logprobs=logprobs,
            finish_reason=reason if reason in ("length", "abort") else "stop",
            version_segments=((0, self.weight_version),))

    def weight_targets(self) -> list[ShardSpec]:
        """Returns the engine's parameters as specs (`tp{r}/` prefixes when tp > 1)."""
        return list(self._targets)

    def begin_weight_update(self, version: int) -> None:
        """Starts a sync towards `version` (clears the per-sync timers)."""
        super().begin_weight_update(version)
        self._sync = Counter()

    def _check_item(self, spec: ShardSpec, tensor: torch.Tensor) -> tuple[int, str]:
        """Checks one `load_weights` item against `weight_targets()`.

        Returns:
            `(tp_rank, engine_name)` of the item.

        Raises:
            ValueError: the spec is not one of `weight_targets()`, or the tensor's shape or
                dtype differs from it.
        """
        where = f"{type(self).__name__}.load_weights"
        target = self._by_name.get(spec.local_name)
        if target is None:
            raise ValueError(f"{where}: {spec.local_name!r} is not one of this engine's "
                             "weight_targets(); plan syncs against weight_targets().")
        if tuple(tensor.shape) != target.local_shape:
            raise ValueError(f"{where}: tensor for {spec.local_name!r} has shape "
                             f"{tuple(tensor.shape)}, expected {target.local_shape}.")
        if str(tensor.dtype).removeprefix("torch.") != target.dtype:
            raise ValueError(f"{where}: tensor for {spec.local_name!r} is {tensor.dtype}, "
                             f"expected {target.dtype}; cast before sending.")
        return split_tp_prefix(spec.local_name)

    def finish_weight_update(self) -> None:
        """Publishes the pending version and this sync's timers as `last_sync`."""
        version = self._pending_version
        super().finish_weight_update()
        self.last_sync = WeightSyncStats(version=version, **self._sync)
        self._sync = Counter()
        del self._pending_version


__all__ = ["TensorParallelRolloutEngine"]
