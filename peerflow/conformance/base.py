"""Shared pieces of the base test classes: adapter resolution, fixtures, skips."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from peerflow.conformance.models import LAYOUT_MODELS, hf_config, model_family
from peerflow.conformance.profile import AdapterProfile, layout_id
from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout

KIND_KEYS = {"rollout": "rollout_engine", "train": "train_engine"}


def resolve_adapter(test_class: type, config: Any) -> type | None:
    """The adapter a suite class tests: its `adapter_class`, else `--peerflow-adapter`."""
    explicit = getattr(test_class, "adapter_class", None)
    if explicit is not None:
        return explicit
    name = config.getoption("peerflow_adapter", None) if config is not None else None
    if not name:
        return None
    from peerflow.plugins import get_plugin_manager

    kinds = [getattr(test_class, "suite_kind", None)] if getattr(
        test_class, "suite_kind", None) else list(KIND_KEYS)
    for kind in kinds:
        registry = get_plugin_manager().registry(KIND_KEYS[kind])
        if name in registry:
            return registry.get(name)
    return None


def needs(request: pytest.FixtureRequest, profile: AdapterProfile, capability: str) -> None:
    """Records the capability a test exercises; skips naming it when it is not declared.

    A flag the adapter declares but this machine cannot give (`machine_limits`) skips too,
    naming the machine and why: the suite answers for the machine it runs on.
    """
    request.node.user_properties.append(("capability", capability))
    if not getattr(profile.cls.capabilities, capability):
        pytest.skip(f"requires Capabilities.{capability}, which {profile.name} does not declare")
    machine = profile.cls.machine_capabilities()  # declared, but this machine cannot
    if not getattr(machine, capability):
        pytest.skip(f"requires Capabilities.{capability}, which {profile.name} cannot give "
                    f"{machine.reasons[capability]}")


def check_layout(request: pytest.FixtureRequest, profile: AdapterProfile,
                 layout: ParallelLayout) -> None:
    """Skips a layout whose mesh needs a capability the adapter lacks."""
    from peerflow.conformance.profile import LAYOUT_CAPABILITIES

    missing = profile.missing_capability(layout)
    exercised = next((flag for dim, flag in LAYOUT_CAPABILITIES.items()
                      if getattr(layout, dim) > 1), None)
    request.node.user_properties.append(("capability", missing or exercised or "core"))
    if missing:
        pytest.skip(f"layout {layout_id(layout)} requires Capabilities.{missing}, which "
                    f"{profile.name} does not declare")


def check_family(profile: AdapterProfile, model_id: str) -> None:
    """Skips a model family the adapter does not list."""
    families = profile.families()
    fam = model_family(model_id)
    if families is not None and fam not in families:
        pytest.skip(f"{profile.name} does not list model family {fam!r} in "
                    "conformance_families()")


def shard_layout_of(profile: AdapterProfile) -> Any:
    """The adapter's `shard_layout` classmethod (skips layers 1–2 without one)."""
    hook = profile.hook("shard_layout")
    if hook is None:
        pytest.skip(f"{profile.name} defines no shard_layout(hf_config, layout, rank) "
                    "classmethod; layers 1-2 test declared layouts through it")
    return hook


def specs_or_skip(profile: AdapterProfile, model_id: str, layout: ParallelLayout,
                  rank_offset: int = 0) -> dict[int, list]:
    """Declared specs of every rank, skipping layouts the adapter refuses for this model."""
    from peerflow.conformance.checks import layout_specs

    shard_layout_of(profile)
    try:
        return layout_specs(profile.cls, hf_config(LAYOUT_MODELS[model_id]), layout,
                            rank_offset)
    except ConfigError as exc:
        pytest.skip(f"{profile.name} refuses layout {layout_id(layout)} for {model_id}: {exc}")


class SuiteBase:
    """Fixtures every layer shares. Subclass a suite and set `adapter_class`."""

    _peerflow_suite: ClassVar[bool] = True
    suite_kind: ClassVar[str | None] = None
    """`rollout` or `train`: which adapters the class applies to."""
    adapter_class: ClassVar[type | None] = None
    """The engine class under test; `None` takes `--peerflow-adapter NAME`."""

    @pytest.fixture
    def adapter(self, request: pytest.FixtureRequest) -> type:
        """The engine class under test. Override, or set `adapter_class`."""
        cls = resolve_adapter(type(self), request.config)
        if cls is None:
            raise NotImplementedError(
                f"{type(self).__name__}: set the class attribute `adapter_class = YourEngine` "
                "(a peerflow RolloutEngine or TrainEngine subclass), override the `adapter` "
                "fixture to return it, or run pytest with --peerflow-adapter NAME."
            )
        return cls

    @pytest.fixture
    def profile(self, adapter: type) -> AdapterProfile:
        """How the suite sees the adapter."""
        return AdapterProfile.of(adapter)

    @pytest.fixture
    def logprob_atol(self) -> float | None:
        """Largest absolute log-prob difference accepted against the reference model.

        `None` (the default) derives it from the reference's own spread across float64
        and two float32 kernel paths (`peerflow.conformance.tolerance`); override with a
        float to fix it.
        """
        return None
