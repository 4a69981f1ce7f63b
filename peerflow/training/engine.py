"""`CausalLMTrainEngine`: the `TrainEngine` contract written once on top of the toolkit.

A train adapter subclasses it and supplies only what its framework does differently:

* `forward_micro(micro)` — the model's output for one padded micro-batch: logits
  `[B, K, V]` of the last `K` positions, `K` at least `micro.inputs.logits_to_keep` (the
  positions that predict response tokens) and at most the width `L` (or the local
  vocabulary slice `[B, K, V / tp]`, see `vocab_shard`), or values `[B, L]` for a
  critic (`produces_values`);
* `backward_micro(loss, micro)` — backward of one micro-batch's loss (scaled to the
  framework's gradient reduction; `micro.last` marks the gradient-sync boundary);
* `optimizer_step()` — clip, step, and return the global gradient norm before clipping;
* `set_training(mode)`, and `zero_grad()` when stepping leaves gradients behind.

Everything else is here, once: the PPO mini-batch split, token-balanced micro-batches
with the same count on every dp-rank, global token and sample counts for the loss,
log-probs and entropy at the sampling temperature (`EngineContext.temperature`),
re-assembling per-sample outputs in batch order, and the step's metrics under the same
names for every engine (`metrics.py`).

Where tensors live (docs/architecture.md): the batch a `TrainEngine` method receives and
everything it returns are on the host. The toolkit is the one place they cross:
`build_micro_batch` moves each micro-batch to `self.device` whole — its model inputs,
every field with its offsets, and its ids — so `forward_micro`, `score` and the
`LossFunction` see device tensors only; `gather_results` brings the log-probs (or values)
back in one copy, and the step's metrics leave as Python numbers. Reductions over the
dp-group carry host numbers (over gloo).

A framework whose schedule runs forward and backward itself (Megatron's pipeline
schedules) overrides `run_micro_batches` (and `plan_micro_batches` for fixed shapes,
`share_from_last_stage`, `is_last_stage`); the objective it calls per micro-batch stays
the toolkit's.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from functools import partial

import attrs
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.distributed.devices import resolve_bf16
from peerflow.engines.base import EngineContext
from peerflow.engines.train import LossFunction, OptimSettings, TrainEngine
from peerflow.routes import OLD_ROUTES
from peerflow.training import lora
from peerflow.training.collectives import global_counts
from peerflow.training.inputs import PaddedInputs, gather_results, pad_inputs
from peerflow.training.logprobs import VocabShard, token_entropy, token_logprobs
from peerflow.training.metrics import StepTally
from peerflow.training.microbatch import plan_micro_batches, split_mini_batches
from peerflow.training.packing import packed_inputs, resolve_padding_free
from peerflow.training.replay_scope import micro_batch_scope
from peerflow.training.routing_replay import RoutingReplay
from peerflow.training.shared_prompts import (
    SharedPromptInputs,
    shared_prompt_inputs,
    shared_prompt_units,
    takes_custom_masks,
)

log = logging.getLogger("peerflow.training")


@attrs.frozen(kw_only=True)
class MicroBatch:
    """One forward (and backward) pass of a train engine."""

    indices: list[int]
    """Positions of its samples in the batch being processed; empty for a filler pass
    that only keeps collectives in step with ranks that have more micro-batches."""
    batch: Batch
    """Those samples, on the engine's device."""
    inputs: PaddedInputs | SharedPromptInputs
    """Their model inputs (one filler row for a filler pass), on the engine's device."""
    last: bool
    """Whether it is the last micro-batch of its mini-batch (gradient-sync boundary)."""


#: `objective(micro, output) -> loss`: what the toolkit does with one micro-batch's output.
Objective = Callable[[MicroBatch, torch.Tensor], torch.Tensor]


class CausalLMTrainEngine(TrainEngine, abc.ABC):
    """A train engine for causal LMs whose contract methods are the toolkit's.

    Subclasses set `self.device` (where the model computes: `EngineContext.device`) and
    `self.dp_group` (the data-parallel group, `None` for one rank) in `__init__`.
    """

    device: torch.device
    dp_group: object | None = None
    produces_values: bool = False
    """The engine is a critic: `forward_micro` returns values `[B, L]`, not logits."""
    is_last_stage: bool = True
    """This rank computes the model's output (the last pipeline stage)."""
    shares_prompts: bool = False
    """`forward_micro` passes `inputs.position_ids` and a 4D `inputs.attention_mask_as(...)`
    to the model, so the samples of one prompt can share a row
    (`peerflow.training.shared_prompts`) instead of each running the prompt."""
    padding_free: bool = False
    """Micro-batches are one row of their samples without padding, planned by real tokens
    (`peerflow.training.packing`): `forward_micro` passes `inputs.position_ids` and
    `inputs.attention_mask_as(...)`, which is `None` unless prompts are shared."""
    routing: RoutingReplay | None = None
    """The MoE routing-replay controller (`attach_routing`); `None` for a dense model."""

    def __init__(self, context: EngineContext, options: object, optim: OptimSettings) -> None:
        """Stores the settings with `optim.bf16` resolved for `context.device`.

        `auto` goes through the device contract (`resolve_bf16`), so adapters read a bool.
        """
        bf16 = resolve_bf16(optim.bf16, context.device)
        super().__init__(context, options, attrs.evolve(optim, bf16=bf16))

    # -- what adapters supply --------------------------------------------------------------

    @abc.abstractmethod
    def forward_micro(self, micro: MicroBatch) -> torch.Tensor:
        """The model's output for `micro.inputs` (logits `[B, K, V]` or values `[B, L]`).

        `micro` is already on `self.device`; so must the output be.
        """

    def backward_micro(self, loss: torch.Tensor, micro: MicroBatch) -> None:
        """Backward of one micro-batch's loss; plain autograd by default.

        Losses are normalised by the global token count, so gradients must be *summed*
        over micro-batches and dp-ranks: a framework that averages over dp scales here.
        """
        loss.backward()

    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Clips, steps, and returns the global gradient norm before clipping."""

    @abc.abstractmethod
    def set_training(self, mode: bool) -> None:
        """Puts the model in training (`True`) or evaluation mode."""

    def zero_grad(self) -> None:
        """Clears gradients before a mini-batch (nothing when stepping clears them)."""

    def current_lr(self) -> float:
        """The learning rate the next optimiser step applies."""
        return float(self.optim.lr)

    def vocab_shard(self) -> VocabShard | None:
        """This rank's slice of a vocab-parallel output layer; `None` for full logits."""
        return None

    def attach_routing(self, model: torch.nn.Module) -> None:
        """Puts `model`'s MoE routers under the one routing-replay controller.

        Adapters holding a `transformers` model call it once, before wrapping the model;
        `optim.routing_replay` picks the mode. A dense model leaves `routing` `None`.
        """
        self.routing = RoutingReplay.attach(model, self.optim.routing_replay)

    def prepare_model(self, model: torch.nn.Module, *, share_prompts: bool,
                      backbone: torch.nn.Module | None = None) -> torch.nn.Module:
        """The steps every adapter takes once its `transformers` model is loaded (once).

        In order: MoE routers under the routing-replay controller (`attach_routing`);
        `trainer.lora`'s adapters (not on a critic: a value-head model trains whole);
        activation checkpointing (`optim.activation_checkpointing`, on `backbone` when
        the model is a value head over one); then `shares_prompts` (the option, where the
        model takes 4-D masks) and `padding_free` are decided on the prepared model.

        Args:
            model: The loaded model, before any wrapping (FSDP, DeepSpeed).
            share_prompts: The adapter's `share_prompts` option.
            backbone: A critic's backbone under its value head; `None` for a policy.

        Returns:
            The model to wrap: `model`, or its peft wrapper with `trainer.lora`.
        """
        critic = backbone is not None
        self.attach_routing(model)
        if self.context.lora is not None and not critic:
            model = lora.apply_lora(model, self.context.lora)
        if self.optim.activation_checkpointing:
            (backbone if critic else model).gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.shares_prompts = share_prompts and not critic and takes_custom_masks(model)
        self.padding_free = resolve_padding_free(self.optim.padding_free, model, self.name)
        return model

    def _replaying(self) -> bool:
        return self.routing is not None and self.routing.mode != "off"

    # -- hooks with defaults ---------------------------------------------------------------

    @property
    def temperature(self) -> float:
        """The sampling temperature log-probs are computed at (`EngineContext`)."""
        return self.context.temperature

    def plan_micro_batches(self, batch: Batch) -> list[MicroBatch]:
        """Token-balanced micro-batches, as many as on every dp-rank (collective).

        With `shares_prompts` the units planned are the rows of samples with the same
        prompt (their tokens counted with the prompt once, each row within the budget;
        `shared_prompt_units`), laid out one row per unit. With `padding_free` the units
        of a micro-batch are concatenated into one row and planned by real tokens.
        """
        lengths = batch.token_count().tolist() if len(batch) else []
        units = [[i] for i in range(len(batch))]
        layout: Callable[[Batch], PaddedInputs | SharedPromptInputs] = pad_inputs
        replay = self._replaying()  # routes are laid out on one padded row per sample
        if self.shares_prompts and len(batch) and not replay:
            units, lengths = shared_prompt_units(batch, self.optim.micro_batch_tokens)
            layout = shared_prompt_inputs
        if self.padding_free and not replay:
            layout = partial(packed_inputs, share_prompts=self.shares_prompts)
        plan = plan_micro_batches(lengths, self.optim.micro_batch_tokens, self.dp_group,
                                  packed=self.padding_free and not replay)
        plan = [[i for unit in bin_ for i in units[unit]] for bin_ in plan]
        return [self.build_micro_batch(batch, indices, k == len(plan) - 1, layout)
                for k, indices in enumerate(plan)]

    def build_micro_batch(self, batch: Batch, indices: list[int], last: bool,
                          layout: Callable[[Batch], PaddedInputs | SharedPromptInputs],
                          ) -> MicroBatch:
        """The micro-batch of `batch[indices]` on `self.device`: the toolkit's crossing.

        The inputs are laid out by `layout` on the host, then the samples (ids, fields,
        offsets) and the inputs move to the device together, once.
        """
        part = batch.select(indices)
        return MicroBatch(indices=indices, batch=part.to(self.device),
                          inputs=layout(part).to(self.device), last=last)

    def run_micro_batches(self, micros: Sequence[MicroBatch], objective: Objective) -> None:
        """Forward (and, with grad enabled, backward) of every micro-batch in order.

        Each micro-batch runs inside its routing-replay scope (MoE models), backward
        included, so recomputed blocks replay the same routes.
        """
        for micro in micros:
            with micro_batch_scope(self.routing, micro):
                loss = objective(micro, self.forward_micro(micro))
                if torch.is_grad_enabled():
                    self.backward_micro(loss, micro)

    def share_from_last_stage(self, value: object) -> object:
        """`value` from the last pipeline stage on every rank (identity without pp)."""
        return value

    # -- the toolkit ------------------------------------------------------------------------

    def score(self, output: torch.Tensor, micro: MicroBatch, *,
              entropy_grad: bool = False) -> tuple[RaggedField, RaggedField | None]:
        """Per-response-token log-probs (or values) and entropies of one micro-batch.

        Log-probs and entropy are those of `softmax(logits / temperature)`; entropy
        carries gradient only with `entropy_grad` (a loss with an entropy term).
        """
        picked = micro.inputs.gather(output)  # [tokens, V] logits, or [tokens] values
        offsets = picked.offsets
        if self.produces_values:
            return RaggedField(values=picked.values.float(), offsets=offsets), None
        shard = self.vocab_shard()
        if entropy_grad and shard is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: an entropy term in the loss needs full-vocabulary "
                "logits; with a vocab-parallel output layer entropy is a metric only."
            )
        targets = micro.inputs.response_targets()
        logits = picked.values
        logprobs = token_logprobs(logits, targets, temperature=self.temperature, shard=shard)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_entropy(logits, temperature=self.temperature, shard=shard)
        return (RaggedField(values=logprobs, offsets=offsets),
                RaggedField(values=entropy, offsets=offsets))

    def _forward_no_grad(self, batch: Batch) -> RaggedField:
        self.set_training(False)
        parts: list[tuple[list[int], RaggedField]] = []

        def collect(micro: MicroBatch, output: torch.Tensor) -> torch.Tensor:
            if micro.indices:
                parts.append((micro.indices, self.score(output, micro)[0]))
            return output.float().sum() * 0.0

        with torch.no_grad():
            self.run_micro_batches(self.plan_micro_batches(batch), collect)
        result = gather_results(len(batch), parts) if self.is_last_stage else None
        return self.share_from_last_stage(result)

    def forward_logprobs(self, batch: Batch) -> RaggedField:
        """Log-probs at the sampling temperature (float32, no grad) of response tokens.

        Collective over the engine's group: every rank calls it (with its own samples).
        Under `trainer.routing_replay: r2` it also adds the pass's routes to `batch`
        (`peerflow.routes.OLD_ROUTES`), which the update then replays.
        """
        if self.produces_values:
            raise RuntimeError(
                f"this {self.name} engine was built as a critic (value head); use "
                "forward_values, or build another engine for log-probs."
            )
        logprobs = self._forward_no_grad(batch)
        if self.routing is not None and self.routing.mode == "r2":
            # the routes of this pass travel with their samples to the update that replays them
            batch.set(OLD_ROUTES, self.routing.take(batch))
        return logprobs

    def forward_values(self, batch: Batch) -> RaggedField:
        """Per-response-token values (float32, no grad) of a critic."""
        if not self.produces_values:
            raise RuntimeError(
                f"forward_values needs a {self.name} engine built as a critic "
                f"(`trainer.{self.name}.value_head: true`)."
            )
        return self._forward_no_grad(batch)

    def train_step(self, batch: Batch, loss: LossFunction) -> dict[str, float]:
        """Runs `optim.mini_batches` optimiser steps on this dp-rank's samples.

        Collective over the engine group. Each mini-batch is a contiguous slice of the
        batch; its micro-batches' gradients are summed (the loss normalises by the global
        counts it is given) over micro-batches and dp-ranks, then clipped by the global
        norm. A mini-batch with no trained token on any rank (every sample left out) is
        skipped with a warning: no forward, no optimizer step. Returns the metrics of
        `peerflow.training.metrics`.
        """
        self.set_training(True)
        tally = StepTally()
        for indices in split_mini_batches(len(batch), self.optim.mini_batches):
            mini = batch.select(indices)
            tokens, samples = global_counts(mini, self.dp_group)
            if tokens == 0:  # every rank agrees (a global count): none steps
                log.warning(
                    "%s.train_step: no trained token in the mini-batch on any dp-rank (every "
                    "sample was left out: train_mask false — failed agent trajectories or "
                    "rewards, overlong filtering — or loss_mask false everywhere); its optimizer "
                    "step is skipped, the weights stay as they are.", type(self).__name__)
                continue
            self.zero_grad()
            objective = partial(self._objective, loss, tally, max(tokens, 1), max(samples, 1))
            self.run_micro_batches(self.plan_micro_batches(mini), objective)
            lr = self.current_lr()  # the rate this step applies; a schedule moves it after
            tally.add_optimizer_step(self.optimizer_step(), lr=lr)
        self.version += 1
        metrics = tally.summary(group=self.dp_group, lr=self.current_lr(),
                                share=self.share_from_last_stage)
        if self.routing is not None:
            metrics.update(self.routing.step_metrics(batch, self.dp_group))
        return metrics

    def _objective(self, loss: LossFunction, tally: StepTally, tokens: int, samples: int,
                   micro: MicroBatch, output: torch.Tensor) -> torch.Tensor:
        if not micro.indices:
            return output.float().sum() * 0.0
        entropy_grad = bool(getattr(loss, "needs_entropy", False))
        values, entropy = self.score(output, micro, entropy_grad=entropy_grad)
        part = micro.batch
        if entropy is not None:
            part.set("entropy", entropy)
        value, metrics = loss(values, part, global_tokens=tokens, global_samples=samples)
        aux = self.routing.aux_loss() if self.routing is not None else None
        if aux is not None and self.optim.router_aux_loss_coef > 0:
            share = int(part.trained_lengths().sum()) / max(tokens, 1)  # sums to 1 per step
            value = value + self.optim.router_aux_loss_coef * share * aux
        mask = part.loss_mask()
        trained_entropy = None if entropy is None else (
            entropy.values if mask is None else entropy.values[mask])
        tally.add_micro_batch(value, metrics, trained_entropy, micro.inputs.input_ids.numel())
        return value
