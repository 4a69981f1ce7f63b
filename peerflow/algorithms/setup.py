"""Builds a run's algorithm pieces from `algorithm:` in the config, through the registry.

The worker calls `build_algorithm` once per process; everything is looked up by name in
the plugin registries, so a third-party estimator or loss is used exactly like a
built-in one.
"""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import torch

from peerflow.algorithms.base import AdvantageEstimator
from peerflow.algorithms.kl import apply_kl_penalty, kl_loss_metrics
from peerflow.algorithms.off_policy import (
    CurrentProximal,
    attach_weights,
    importance_weights,
    mismatch_metrics,
    record_metrics,
)
from peerflow.algorithms.overlong import shape_overlong
from peerflow.algorithms.regularized import RegularizedLoss
from peerflow.algorithms.turn_rewards import add_turn_rewards
from peerflow.batch import Batch
from peerflow.config.schema import OffPolicyConfig, OverlongConfig


@attrs.define(eq=False)
class Algorithm:
    """The configured estimator, losses, KL, off-policy and DAPO settings of one run.

    The worker calls `shape_rewards` in the advantage node (before the estimator) and
    `prepare_actor_batch` in the train node (before `train_step`).
    """

    estimator: AdvantageEstimator
    """Turns rewards (and values) into advantages (the `advantage` node)."""
    policy_loss: Any
    """The actor's `LossFunction`: the configured loss (in a `RegularizedLoss` with KL in
    the loss or an entropy bonus) in a `CurrentProximal` (the proximal fast path)."""
    value_loss: Any | None
    """The critic's `LossFunction` when the estimator needs values, else `None`."""
    kl_coef: float
    """KL coefficient (0: no reference model is needed)."""
    kl_estimator: str
    """`k1`, `k2` or `k3` (resolved: `k1` by default in reward mode, `k3` in loss mode)."""
    kl_mode: str
    """`loss` or `reward`."""
    dynamic_sampling: bool
    """Whether the worker drops all-equal-reward groups and refills (DAPO)."""
    off_policy: OffPolicyConfig = attrs.Factory(OffPolicyConfig)
    """`algorithm.off_policy`: the importance-weight correction."""
    overlong: OverlongConfig = attrs.Factory(OverlongConfig)
    """`algorithm.overlong`: DAPO's overlong shaping and filtering."""
    max_tokens: int = 0
    """`rollout.sampling.max_tokens` (the overlong punishment's budget)."""
    turn_rewards: str = "sum"
    """`algorithm.turn_rewards`: whether outcome-only estimators get multi-turn
    trajectories' per-turn rewards summed into `reward`."""

    @property
    def sums_turn_rewards(self) -> bool:
        """Whether `shape_rewards` adds summed `token_rewards` to `reward` (grpo, rloo)."""
        return self.turn_rewards == "sum" and not type(self.estimator).uses_token_rewards

    @property
    def needs_reference(self) -> bool:
        """Whether the `ref_logprob` node must run."""
        return self.kl_coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """Whether `kl_penalty` changes the rewards before the advantage node."""
        return self.kl_coef > 0 and self.kl_mode == "reward"

    @property
    def shapes_rewards(self) -> bool:
        """Whether `shape_rewards` does anything (turn-reward sums, KL, overlong)."""
        return (self.sums_turn_rewards or self.kl_in_reward or self.overlong.buffer > 0
                or self.overlong.filter)

    def kl_penalty(self, batch: Any) -> dict[str, float]:
        """Applies the configured KL reward penalty to `batch` in place; returns metrics.

        Per token (into `token_rewards`) for estimators that read them (`gae`,
        `reinforce_pp`), summed into the sample's `reward` otherwise. A no-op (empty
        metrics) unless `kl_in_reward`.
        """
        if not self.kl_in_reward:
            return {}
        return apply_kl_penalty(batch, self.kl_coef, self.kl_estimator,
                                per_token=type(self.estimator).uses_token_rewards)

    def shape_rewards(self, batch: Any, metrics: Any) -> None:
        """Per-turn reward sums, overlong shaping and filtering, the KL penalty, in place.

        For an outcome-only estimator with `turn_rewards: sum`, a multi-turn trajectory's
        per-turn rewards (`token_rewards`) are added to its `reward` first (see
        `peerflow.algorithms.turn_rewards`), so `score` then keeps that sum.

        Args:
            batch: The advantage node's batch (whole groups, with `reward`).
            metrics: A `StepMetrics`; the means are weighted by the sample count.
        """
        values = add_turn_rewards(batch) if self.sums_turn_rewards else {}
        overlong = self.overlong
        if overlong.buffer > 0 or overlong.filter:
            values.update(shape_overlong(
                batch, max_tokens=self.max_tokens, buffer=overlong.buffer,
                penalty=overlong.penalty, filter_truncated=overlong.filter))
        values.update(self.kl_penalty(batch))
        for name, value in values.items():
            metrics.mean(name, value, len(batch))

    def prepare_actor_batch(self, batch: Batch, metrics: Any) -> Batch:
        """The batch the actor's `train_step` gets, and this step's off-policy metrics.

        Drops samples whose `train_mask` is false (`trained_samples`), so they count in
        no normaliser; attaches the decoupled-PPO weights `is_weights`; records
        `off_policy/*` (importance weights), `mismatch/*` (rollout vs trainer log-probs)
        and, with KL in the loss, `kl/mean` and `kl/loss` of the policy before the
        update, over the whole step.
        """
        if "train_mask" in batch:
            keep = batch["train_mask"].to(torch.bool)
            metrics.mean("actor/masked_fraction", float((~keep).double().mean()) if len(batch)
                         else 0.0, len(batch))
            batch = trained_samples(batch)
        record_metrics(metrics, mismatch_metrics(batch))
        correction = self.off_policy.correction
        weights = importance_weights(batch, correction, self.off_policy.cap,
                                     self.off_policy.lower)
        if weights is not None:
            batch = attach_weights(batch, weights)
            record_metrics(metrics, weights.metrics(correction))
        if self.kl_coef > 0 and self.kl_mode == "loss":
            record_metrics(metrics, kl_loss_metrics(batch, self.kl_coef, self.kl_estimator,
                                                    self.policy_loss))
        return batch


def trained_samples(batch: Batch) -> Batch:
    """The samples a train step uses: those whose `train_mask` is true (all without one).

    Overlong filtering, dynamic sampling's flat top-up groups and trajectories the
    environment or the reward failed (`peerflow.algorithms.failed_samples`) clear it.
    """
    if "train_mask" not in batch:
        return batch
    return batch.select(batch["train_mask"].to(torch.bool).nonzero().flatten())


def build_algorithm(
    algorithm: Any, *, max_tokens: int = 0, plugin_manager: Any = None,
    process_group: Any = None, group_replicas: int = 1,
) -> Algorithm:
    """Instantiates estimator and losses named by an `AlgorithmConfig`.

    Args:
        algorithm: `config.algorithm` (an `AlgorithmConfig`).
        max_tokens: `rollout.sampling.max_tokens`, the constant length of the
            `seq-mean-token-sum-norm` aggregation when the loss leaves `norm_length` at 0.
        plugin_manager: A `PluginManager`; default this process's.
        process_group: The group the estimator's batch-wide statistics (whitening)
            reduce over (`AdvantageEstimator.process_group`); `None`: one batch.
        group_replicas: How many ranks of that group hold each dp-shard.

    Raises:
        UnknownNameError: an estimator or loss name nobody registers.
        ConfigError: an option section does not validate.
    """
    from peerflow.config.loader import structure_options
    from peerflow.plugins import get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    estimator_cls = pm.registry("advantage_estimator").get(algorithm.advantage)
    loss_cls = pm.registry("policy_loss").get(algorithm.loss)
    sections = algorithm.options
    estimator = estimator_cls(structure_options(
        estimator_cls.options_class, sections.get(algorithm.advantage),
        f"algorithm.options.{algorithm.advantage}"))
    estimator.process_group, estimator.group_replicas = process_group, group_replicas
    loss_options = structure_options(
        loss_cls.options_class, sections.get(algorithm.loss), f"algorithm.options.{algorithm.loss}")
    changes: dict[str, Any] = {}
    fields = attrs.fields_dict(type(loss_options)) if attrs.has(type(loss_options)) else {}
    preferred = estimator.preferred_aggregation
    if "aggregation" in fields and loss_options.aggregation is None and preferred:
        changes["aggregation"] = preferred
    if "norm_length" in fields and loss_options.norm_length == 0 and max_tokens > 0:
        changes["norm_length"] = max_tokens
    if changes:
        loss_options = attrs.evolve(loss_options, **changes)
    policy_loss: Any = loss_cls(loss_options)
    kl = algorithm.kl
    estimator_name = kl.resolved_estimator
    kl_in_loss = kl.coef > 0 and kl.mode == "loss"
    if kl_in_loss and estimator_name == "k1":
        warnings.warn(
            "algorithm.kl.estimator=k1 with kl.mode=loss: k1's expected gradient is zero "
            "(E[grad log p] = 0), so the KL term does not regularise; use k2 (gradient of "
            "KL(policy || ref)) or k3 (gradient of KL(ref || policy)), or kl.mode: reward.",
            stacklevel=2,
        )
    if kl_in_loss or algorithm.entropy_coef > 0:
        policy_loss = RegularizedLoss(
            policy_loss, kl_coef=kl.coef if kl_in_loss else 0.0, kl_estimator=estimator_name,
            entropy_coef=algorithm.entropy_coef)
    policy_loss = CurrentProximal(policy_loss, algorithm.off_policy)
    value_loss = None
    if estimator_cls.needs_values:
        make = getattr(estimator, "value_loss", None)
        if make is None:
            from peerflow.algorithms.value_loss import ClippedValueLoss

            value_loss = ClippedValueLoss()
        else:
            value_loss = make()
    return Algorithm(
        estimator=estimator, policy_loss=policy_loss, value_loss=value_loss,
        kl_coef=kl.coef, kl_estimator=estimator_name, kl_mode=kl.mode,
        dynamic_sampling=algorithm.dynamic_sampling, off_policy=algorithm.off_policy,
        overlong=algorithm.overlong, max_tokens=max_tokens,
        turn_rewards=algorithm.turn_rewards,
    )



def check_model_builder(config: Any, pm: Any) -> list[str]:
    """A config check (`peerflow.algorithms.plugin` registers it): checks `model.builder_options`.

    `validate_config` does not look at the builder; this asks the builder task's
    `check_builder_options` (which builds nothing), so a bad option is reported before
    any process starts.

    Returns:
        One message per problem (empty when the config is fine).
    """
    model = config.model
    if model.path or not model.builder:
        return []
    registry = pm.registry("task")
    if model.builder not in registry:
        return [registry.unknown_message(model.builder).replace("(task.name)", "(model.builder)")]
    return list(registry.get(model.builder).check_builder_options(dict(model.builder_options)))


def staleness_bound(config: Any) -> int:
    """Most weight versions a trained sample can lag the trainer by under `config`.

    `runtime.max_staleness` in async mode; `weight_sync.every - 1` in sync mode (the
    rollout engine keeps old weights between syncs).
    """
    if config.runtime.mode == "async":
        return max(config.runtime.max_staleness, 0)
    return max(config.weight_sync.every, 1) - 1


def _group_problems(config: Any, pm: Any) -> list[str]:
    """A group-relative estimator with one answer per prompt: every advantage is 0."""
    from peerflow.config.loader import structure_options

    algorithm, n = config.algorithm, config.rollout.sampling.n
    registry = pm.registry("advantage_estimator")
    if n >= 2 or algorithm.advantage not in registry:
        return []  # an unknown name is reported by the name check
    cls = registry.get(algorithm.advantage)
    try:
        estimator = cls(structure_options(cls.options_class,
                                          algorithm.options.get(algorithm.advantage),
                                          f"algorithm.options.{algorithm.advantage}"))
    except Exception:  # bad options are reported by the options check
        return []
    if not estimator.compares_within_groups:
        return []
    return [f"algorithm.advantage={algorithm.advantage!r} compares the answers to one prompt, "
            f"but rollout.sampling.n={n}: every advantage would be 0 and the run would learn "
            "nothing; set rollout.sampling.n to 2 or more (4-16 is usual), or use an "
            "estimator without groups (reinforce_pp, gae)."]


def check_algorithm(config: Any, pm: Any) -> list[str]:
    """A config check (`peerflow.algorithms.plugin` registers it): settings the run can't use.

    Refuses a group-relative estimator (GRPO, RLOO, REINFORCE++-baseline) with one answer
    per prompt, and a run whose samples can be stale (async mode with `max_staleness > 0`,
    sync mode with `weight_sync.every > 1`) when `algorithm.off_policy.correction` is `none`
    or the policy loss does not apply importance weights, and an overlong buffer longer
    than the generation budget.

    Returns:
        One message per problem (empty when the config is fine).
    """
    algorithm = config.algorithm
    max_tokens = config.rollout.sampling.max_tokens
    problems = []
    if algorithm.overlong.buffer > max_tokens:
        problems.append(
            f"algorithm.overlong.buffer={algorithm.overlong.buffer} exceeds "
            f"rollout.sampling.max_tokens={max_tokens}; the soft punishment starts at "
            "max_tokens - buffer, so lower the buffer (0 disables it)."
        )
    problems += _group_problems(config, pm)
    lag = staleness_bound(config)
    if lag == 0:
        return problems
    why = (f"runtime.mode={config.runtime.mode} with runtime.max_staleness={lag}"
           if config.runtime.mode == "async" else f"weight_sync.every={config.weight_sync.every}")
    if algorithm.off_policy.correction == "none":
        problems.append(
            f"algorithm.off_policy.correction=none, but {why} trains on samples up to {lag} "
            "weight version(s) old, whose gradient is then biased; set "
            "algorithm.off_policy.correction to tis (the default) or mis."
        )
    registry = pm.registry("policy_loss")
    if algorithm.loss in registry:
        loss_cls = registry.get(algorithm.loss)
        if not getattr(loss_cls, "applies_importance_weights", False):
            problems.append(
                f"algorithm.loss={algorithm.loss!r} does not apply importance weights "
                f"(PolicyLoss.applies_importance_weights is false), but {why} trains on "
                f"samples up to {lag} weight version(s) old; use a loss that does "
                "(ppo_clip, gspo), or make samples fresh (runtime.max_staleness: 0 / "
                "weight_sync.every: 1)."
            )
    return problems
