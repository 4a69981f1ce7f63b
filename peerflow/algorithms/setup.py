"""Builds a run's algorithm pieces from `algorithm:` in the config, through the registry.

The worker calls `build_algorithm` once per process; everything is looked up by name in
the plugin registries, so a third-party estimator or loss is used exactly like a
built-in one.
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.algorithms.base import AdvantageEstimator
from peerflow.algorithms.kl import KLRegularizedLoss, apply_kl_penalty


@attrs.define(eq=False)
class Algorithm:
    """The configured estimator, losses and KL settings of one run."""

    estimator: AdvantageEstimator
    """Turns rewards (and values) into advantages (the `advantage` node)."""
    policy_loss: Any
    """The actor's `LossFunction` (KL-regularised when `kl.mode == "loss"`)."""
    value_loss: Any | None
    """The critic's `LossFunction` when the estimator needs values, else `None`."""
    kl_coef: float
    """KL coefficient (0: no reference model is needed)."""
    kl_estimator: str
    """`k1`, `k2` or `k3`."""
    kl_mode: str
    """`loss` or `reward`."""
    dynamic_sampling: bool
    """Whether the worker drops all-equal-reward groups and refills (DAPO)."""

    @property
    def needs_reference(self) -> bool:
        """Whether the `ref_logprob` node must run."""
        return self.kl_coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """Whether to call `kl_penalty` (or `apply_kl_penalty`) before the advantage node."""
        return self.kl_coef > 0 and self.kl_mode == "reward"

    def kl_penalty(self, batch: Any) -> dict[str, float]:
        """Applies the configured KL reward penalty to `batch` in place; returns metrics.

        Per token for estimators that read `token_rewards`, on the sample's reward
        otherwise. A no-op (empty metrics) unless `kl_in_reward`.
        """
        if not self.kl_in_reward:
            return {}
        return apply_kl_penalty(batch, self.kl_coef, self.kl_estimator,
                                per_token=type(self.estimator).uses_token_rewards)


def build_algorithm(
    algorithm: Any, *, max_tokens: int = 0, plugin_manager: Any = None
) -> Algorithm:
    """Instantiates estimator and losses named by an `AlgorithmConfig`.

    Args:
        algorithm: `config.algorithm` (an `AlgorithmConfig`).
        max_tokens: `rollout.sampling.max_tokens`, the constant length of the
            `seq-mean-token-sum-norm` aggregation when the loss leaves `norm_length` at 0.
        plugin_manager: A `PluginManager`; default this process's.

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
    if kl.coef > 0 and kl.mode == "loss":
        policy_loss = KLRegularizedLoss(policy_loss, kl.coef, kl.estimator)
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
        kl_coef=kl.coef, kl_estimator=kl.estimator, kl_mode=kl.mode,
        dynamic_sampling=algorithm.dynamic_sampling,
    )



def check_model_builder(config: Any, pm: Any) -> list[str]:
    """A `peerflow.config.EXTRA_VALIDATORS` entry: checks `model.builder_options`.

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
