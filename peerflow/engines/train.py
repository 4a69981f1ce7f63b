"""The train engine contract.

Designed against torch FSDP2 (`fully_shard`, DTensor local shards), DeepSpeed
(`deepspeed.initialize`, ZeRO-1/2/3 with `GatheredParameters`, `save_checkpoint`) and
Megatron-core (`GPTModel` with tp/pp, vocab-parallel logits, fused QKV and gate/up).

Call order on the ranks that host the engine (all ranks of its group, SPMD):

1. `__init__(context, options, optim)` — build model and optimiser from
   `context.model_path`.
2. `weight_sources()` — once (metadata only); the runtime plans syncs from these specs.
3. Repeatedly: `forward_logprobs(batch)`, `train_step(batch, loss)`; with
   `Capabilities.value_head`: `forward_values(batch)`.
4. For each weight sync, per bucket: `with materialize(specs) as tensors:` on **every**
   rank of the group in the same order (it may run collectives, e.g. a ZeRO-3 gather of
   exactly that bucket's parameters); every rank holding a region may send it — the planner
   shares the bytes among replicas (`peerflow.reshard.senders`), so replicas must hold
   the same values.
5. With `Capabilities.checkpoint`: `save_checkpoint(dir)` / `load_checkpoint(dir)` on all
   ranks; the classmethod `saved_shards(dir, ...)` describes what such a directory holds
   as pieces of HF tensors, without building the engine (`peerflow export` reads it).
6. `shutdown()` — by the worker when the run ends or fails.

Who calls what: `forward_logprobs` — the `ref_logprob` and `old_logprob` nodes;
`train_step` — the `train_actor`/`train_critic` nodes; `forward_values` — the `values`
node of the PPO graph, only with `Capabilities.value_head`; `weight_sources`/`materialize`
— the weight-sync service (`peerflow.reshard.service`); `save_checkpoint` — the run
driver's checkpoint cadence (`peerflow.checkpoint.api`), `load_checkpoint` — resume and
`peerflow eval`, both only with `Capabilities.checkpoint`; `saved_shards` — `peerflow
export` (`peerflow.hf_export`), in a plain process.

Override rules: `__init__` calls `super().__init__(context, options, optim)` first (it
stores the three and sets `version` to 0); `train_step` increments `version` once per
call. Optional methods (`forward_values`, `save_checkpoint`, `load_checkpoint`,
`saved_shards`) raise `NotImplementedError` naming the capability, and the runtime never
calls them on an engine that does not declare it. A subclass of
`peerflow.training.CausalLMTrainEngine` (the base an author builds on) sets `self.device`
and `self.dp_group` and implements `forward_micro`, `optimizer_step`, `set_training`,
`weight_sources` and `materialize` (`backward_micro` when its framework does not use plain
autograd); the toolkit supplies `forward_logprobs`, `forward_values` and `train_step`.

Batches given to the engine carry ragged `prompt_ids` and `response_ids` fields; every tp/pp
peer of one dp-rank receives the same samples.

Where tensors live: the batches an engine receives are on the host, and what it returns
(`forward_logprobs`, `forward_values`: host ragged fields; `train_step`: Python numbers)
is on the host. The engine computes on `EngineContext.device` and crosses between the two
itself, in one place; `CausalLMTrainEngine` does it for its subclasses. Weight tensors
(`materialize`) stay on the engine's device: the weight-sync service moves them.

Log-probs (`forward_logprobs`, and those handed to the loss in `train_step`) are those of
the distribution the rollout sampled from: `log_softmax(logits / T)[token]` over the full
vocabulary, with `T = EngineContext.temperature` (the run's `rollout.sampling.temperature`),
so the reference model, the old-policy forward and the trained policy all score the same
tempered policy the samples came from. Top-p / top-k truncation is **not** renormalised:
the trainer scores the tempered, untruncated distribution, as verl's actor and TRL's GRPO
trainer do (both divide the logits by the temperature and pass top-p/top-k to the
generator only); rollout engines report log-probs under the same contract, so on-policy
ratios are 1. See `peerflow.training.logprobs` for why.

Train engines that build on `peerflow.training.CausalLMTrainEngine` get all of this, the
micro-batching and the metric names, from the training toolkit.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.engines.base import EngineBase, EngineContext
from peerflow.engines.settings import OptimSettings
from peerflow.shard import ShardSpec


class LossFunction(Protocol):
    """A policy (or value) loss evaluated on one micro-batch.

    Engines call it once per micro-batch and sum the returned losses' gradients, so a loss
    must scale itself by the *global* normaliser it is given, not by the micro-batch size.

    The micro-batch also carries `entropy` (ragged, aligned with `response_ids`): the
    entropy of the tempered policy at every response token. It has gradient only when the
    loss object sets `needs_entropy = True` (an entropy bonus); otherwise it is
    detached, for metrics.

    A micro-batch with a `loss_mask` field (ragged bool; false on a multi-turn
    trajectory's observation tokens) must leave its false tokens out of the loss, its
    normalisers and its metrics (`peerflow.algorithms.aggregation.aggregate(mask=...)`).

    Device: `logprobs` and every tensor of `batch` (ids, fields, offsets) are on the
    engine's device, the same one; a loss creates what it needs there (`device=` of its
    inputs) and never moves its inputs. It returns the loss on that device and its
    metrics as Python floats.
    """

    def __call__(
        self,
        logprobs: RaggedField,
        batch: Batch,
        *,
        global_tokens: int,
        global_samples: int,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns `(loss, metrics)` for one micro-batch.

        Args:
            logprobs: Current-policy log-probs of every response token (with grad),
                aligned with `batch["response_ids"]`.
            batch: The micro-batch, with the fields the loss reads (advantages, …).
            global_tokens: Trained response tokens (`loss_mask` true, all without one)
                in the whole mini-batch across dp-ranks.
            global_samples: Samples with at least one trained token in the whole
                mini-batch across dp-ranks.
        """


@attrs.frozen(kw_only=True)
class SavedShard:
    """One tensor of a train engine's checkpoint, as pieces of HF tensors, read on demand."""

    source: int
    """Which saved part holds it (e.g. the saving rank); `spec.local_name` is unique
    within one source."""
    spec: ShardSpec
    """The tensor's name and shape in the checkpoint and the HF regions it holds
    (`replica > 0`: a copy, read only where no replica 0 covers a region)."""
    read: Callable[[], torch.Tensor]
    """Returns the tensor (host memory), of shape `spec.local_shape`."""

    @classmethod
    def in_file(cls, path: str, *, source: int, spec: ShardSpec) -> SavedShard:
        """A shard stored in a safetensors file under `spec.local_name`, read when needed."""

        def read() -> torch.Tensor:
            from safetensors import safe_open

            with safe_open(path, "pt") as handle:
                return handle.get_tensor(spec.local_name)

        return cls(source=source, spec=spec, read=read)


class TrainEngine(EngineBase, abc.ABC):
    """A training engine: log-prob forward, optimiser steps, sharded weight export."""

    def __init__(self, context: EngineContext, options: object, optim: OptimSettings) -> None:
        self.context = context
        self.options = options
        self.optim = optim
        self.capabilities = type(self).machine_capabilities()  # what this machine allows
        self.version = 0

    @abc.abstractmethod
    def forward_logprobs(self, batch: Batch) -> RaggedField:
        """Returns per-response-token log-probs (no grad), aligned with `response_ids`.

        Log-probs of `softmax(logits / EngineContext.temperature)`, untruncated.
        """

    @abc.abstractmethod
    def train_step(self, batch: Batch, loss: LossFunction) -> dict[str, float]:
        """Runs `optim.mini_batches` optimiser steps on this dp-rank's samples.

        Increments `version` once per call. Returns the loss's metrics averaged over
        micro-batches, plus `loss` (the mini-batch loss summed over dp-ranks, averaged
        over mini-batches), `entropy` (token mean of the tempered policy's entropy; policy
        engines), `grad_norm` (global, before clipping) and `lr`.
        """

    def forward_values(self, batch: Batch) -> RaggedField:
        """Returns per-response-token values (needs `Capabilities.value_head`)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not declare Capabilities.value_head."
        )

    @abc.abstractmethod
    def weight_sources(self) -> list[ShardSpec]:
        """Returns the specs of the tensors this rank can send (metadata only)."""

    @abc.abstractmethod
    def materialize(
        self, specs: Sequence[ShardSpec]
    ) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Context manager yielding the tensors of `specs` (a subset of `weight_sources`).

        Called on every rank of the group with the same specs, bucket by bucket, so a
        ZeRO-3 engine gathers only that bucket. Tensors are valid inside the `with`.
        """

    def save_checkpoint(self, directory: str) -> None:
        """Saves model and optimiser state (needs `Capabilities.checkpoint`)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not declare Capabilities.checkpoint."
        )

    def load_checkpoint(self, directory: str) -> None:
        """Restores what `save_checkpoint` wrote (needs `Capabilities.checkpoint`)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not declare Capabilities.checkpoint."
        )

    @classmethod
    def saved_shards(cls, directory: str, *, model_path: str,
                     options: Any = None) -> list[SavedShard]:
        """What a `save_checkpoint` directory holds, as HF-named shards.

        Needs `Capabilities.checkpoint`. Called in a plain process: no process group, no
        engine built, no accelerator. `peerflow.hf_export` assembles the shards into whole HF
        tensors.

        Args:
            directory: What `save_checkpoint` wrote (every rank's part).
            model_path: The HF model directory the run started from (its `config.json`).
            options: The engine's options of the run (`options_class`), or `None`.
        """
        raise NotImplementedError(
            f"{cls.__name__} does not describe its checkpoints (saved_shards); it cannot be "
            "exported."
        )

    def shutdown(self) -> None:
        """Releases the engine's memory and process groups. Safe to call twice."""


def tensors_of(specs: Sequence[ShardSpec], named: Mapping[str, torch.Tensor],
               engine: str) -> list[torch.Tensor]:
    """`materialize` helper: the tensors named by the specs' `local_name`, in order.

    Raises:
        KeyError: A spec names no tensor of the engine (names the first few).
    """
    missing = [s.local_name for s in specs if s.local_name not in named]
    if missing:
        raise KeyError(
            f"{engine} engine has no tensors {missing[:3]}; materialize takes specs returned "
            "by weight_sources()."
        )
    return [named[s.local_name] for s in specs]


@contextlib.contextmanager
def yield_tensors(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`materialize` helper for engines whose local shards are already plain tensors."""
    yield tensors


__all__ = [
    "EngineContext", "LossFunction", "OptimSettings", "SavedShard", "TrainEngine", "tensors_of",
    "yield_tensors",
]
