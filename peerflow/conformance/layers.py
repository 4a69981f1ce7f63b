"""Layers 0–2 of the conformance suite: surface, layout invariants, CPU round trip."""

from __future__ import annotations

import inspect

import attrs
import pytest

from peerflow.capabilities import Capabilities
from peerflow.conformance.base import (
    KIND_KEYS,
    SuiteBase,
    check_family,
    check_layout,
    shard_layout_of,
    specs_or_skip,
)
from peerflow.conformance.checks import (
    canonical_specs,
    check_coverage,
    check_replicas,
    check_well_formed,
    layout_specs,
    round_trip,
)
from peerflow.conformance.models import LAYOUT_MODELS, hf_config
from peerflow.conformance.profile import layout_id
from peerflow.errors import ConfigError
from peerflow.models import hf_parameters

layer0 = pytest.mark.peerflow_layer(0)
layer1 = pytest.mark.peerflow_layer(1)
layer2 = pytest.mark.peerflow_layer(2)

_UNSUPPORTED = {
    "rollout": {"sleep": ("sleep", "wake"), "partial_rollout": ("pause", "resume")},
    "train": {"checkpoint": ("save_checkpoint", "load_checkpoint")},
}


def fail_listing(problems: list[str], what: str) -> None:
    """Fails the test listing the first eight `problems` under `what` (none: passes)."""
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  … and {len(problems) - 8} more" if len(problems) > 8 else ""
        pytest.fail(f"{what}:\n  {shown}{more}", pytrace=False)


class Layer0Surface(SuiteBase):
    """Layer 0: the adapter implements the contract and declares capabilities."""

    @layer0
    def test_l0_is_a_concrete_engine(self, profile):
        """The class subclasses the right engine contract and implements every abstract method."""
        abstract = sorted(getattr(profile.cls, "__abstractmethods__", ()))
        assert not inspect.isabstract(profile.cls), (
            f"{profile.name} leaves abstract methods unimplemented: {abstract}")
        if self.suite_kind:
            assert profile.kind == self.suite_kind

    @layer0
    def test_l0_registered_under_its_name(self, profile):
        """The plugin registry returns this class for its `name`."""
        from peerflow.plugins import get_plugin_manager

        registry = get_plugin_manager().registry(KIND_KEYS[profile.kind])
        assert isinstance(profile.cls.name, str) and profile.cls.name, "set `name = \"…\"`"
        assert profile.name in registry and registry.get(profile.name) is profile.cls, (
            f"{profile.name} is not registered; implement peerflow_register_{profile.kind}"
            "_engines in a module listed under the `peerflow` entry-point group")

    @layer0
    def test_l0_declares_capabilities(self, profile):
        """`capabilities` is a `peerflow.Capabilities` instance."""
        assert isinstance(profile.cls.capabilities, Capabilities), (
            f"{profile.name}.capabilities must be a peerflow.Capabilities instance")

    @layer0
    def test_l0_options_build_with_defaults(self, profile):
        """`options_class` is an attrs class that builds with no arguments."""
        options_class = profile.cls.options_class
        assert attrs.has(options_class), f"{options_class!r} is not an attrs class"
        options_class()

    @layer0
    def test_l0_requirements_have_an_install_hint(self, profile):
        """Engines needing extra packages say how to install them."""
        requires = profile.cls.requires
        assert all(isinstance(m, str) for m in requires)
        if requires:
            assert profile.cls.install_hint, f"{profile.name} requires {requires} but gives " \
                "no install_hint"

    @layer0
    def test_l0_undeclared_abilities_raise_naming_the_capability(self, profile):
        """Methods of undeclared capabilities raise `NotImplementedError` naming the flag."""
        instance = object.__new__(profile.cls)
        for capability, methods in _UNSUPPORTED[profile.kind].items():
            for method in methods:
                if getattr(profile.cls.capabilities, capability):
                    base = inspect.getmro(profile.cls)[-2]
                    assert getattr(profile.cls, method) is not getattr(base, method, None), (
                        f"{profile.name} declares {capability} but does not override {method}")
                    continue
                with pytest.raises(NotImplementedError, match=capability):
                    getattr(instance, method)("/nonexistent") if profile.kind == "train" \
                        else getattr(instance, method)()

    @layer0
    def test_l0_conformance_hooks_are_well_formed(self, profile, request):
        """`shard_layout` exists; xfail declarations name real tests; layouts are listed."""
        shard_layout_of(profile)
        known = {name for name, _ in inspect.getmembers(type(self)) if name.startswith("test_")}
        for pattern in profile.xfails():
            assert pattern in known or "*" in pattern or "[" in pattern, (
                f"conformance_xfail() names {pattern!r}, which is no test of the suite")
        assert profile.layouts(), "conformance_layouts() returned no layout"


class Layer1Layouts(SuiteBase):
    """Layer 1: invariants of the declared shards for several models and layouts."""

    @layer1
    def test_l1_shards_are_well_formed(self, profile, layout_model, layout, request):
        """Declared specs use HF names and shapes and tile every local tensor exactly."""
        check_family(profile, layout_model)
        check_layout(request, profile, layout)
        specs = specs_or_skip(profile, layout_model, layout)
        fail_listing(check_well_formed(specs, hf_parameters(LAYOUT_MODELS[layout_model])),
                     f"{layout_model} {layout_id(layout)}")

    @layer1
    def test_l1_shards_cover_the_model(self, profile, layout_model, layout, request):
        """The ranks together hold every HF element (train: replica 0 exactly once)."""
        check_family(profile, layout_model)
        check_layout(request, profile, layout)
        specs = specs_or_skip(profile, layout_model, layout)
        exactly_once = profile.kind == "train"
        fail_listing(check_coverage(specs, hf_parameters(LAYOUT_MODELS[layout_model]),
                             exactly_once=exactly_once),
                     f"{layout_model} {layout_id(layout)} coverage")

    @layer1
    def test_l1_copies_are_marked_as_replicas(self, profile, layout_model, layout, request):
        """Data held by several ranks (dp replicas, tp copies) has one replica-0 holder.

        Rollout adapters too: two rollout replicas both declaring `replica=0` pass every
        other check here but cannot be the source of a sync (layer 2 would fail with a
        `ShardError` in a trainer-layout test).
        """
        check_family(profile, layout_model)
        check_layout(request, profile, layout)
        specs = specs_or_skip(profile, layout_model, layout)
        fail_listing(check_replicas(specs, profile.cls.__qualname__),
                     f"{profile.name} {layout_model} {layout_id(layout)} replicas")

    @layer1
    def test_l1_layout_is_deterministic(self, profile, layout_model, layout, request):
        """`shard_layout` returns the same specs when called twice."""
        check_family(profile, layout_model)
        check_layout(request, profile, layout)
        assert specs_or_skip(profile, layout_model, layout) == \
            specs_or_skip(profile, layout_model, layout)

    @layer1
    def test_l1_declared_dtype_follows_the_argument(self, profile, layout_model, request):
        """`shard_layout(…, dtype="bfloat16")` declares bfloat16 local tensors."""
        hook = shard_layout_of(profile)
        if "dtype" not in inspect.signature(hook).parameters:
            pytest.skip(f"{profile.name}.shard_layout takes no dtype argument; add "
                        "`dtype=\"float32\"` so runs in other dtypes plan the right sizes")
        check_family(profile, layout_model)
        layout = profile.layouts()[0]
        try:
            specs = profile.shard_layout(hf_config(LAYOUT_MODELS[layout_model]), layout, 0,
                                         dtype="bfloat16")
        except ConfigError as exc:
            pytest.skip(f"{profile.name} refuses {layout_id(layout)} for {layout_model}: {exc}")
        fail_listing([f"{s.local_name}: dtype {s.dtype!r}, asked for 'bfloat16'" for s in specs
               if s.dtype != "bfloat16"], f"{profile.name} {layout_model} dtype")


class Layer2RoundTrip(SuiteBase):
    """Layer 2: CPU reshards against the oracle, `torch.arange` weights, every layout pair."""

    @layer2
    def test_l2_canonical_to_layout(self, profile, layout_model, layout, request):
        """Canonical HF tensors reshard into (or out of) the layout exactly, and back."""
        check_family(profile, layout_model)
        check_layout(request, profile, layout)
        canonical = hf_parameters(hf_config(LAYOUT_MODELS[layout_model]))
        specs = specs_or_skip(profile, layout_model, layout)
        if profile.kind == "train":
            src, dst = specs, canonical_specs(canonical)
        else:
            src, dst = canonical_specs(canonical), specs
        fail_listing(round_trip(src, dst, canonical),
                     f"{profile.name} {layout_model} canonical<->{layout_id(layout)}")

    @layer2
    def test_l2_reshard_between_layouts(self, profile, layout_model, layout_pair, request):
        """Every layout pair, world-size changes included, reshards exactly and back."""
        check_family(profile, layout_model)
        src_layout, dst_layout = layout_pair
        check_layout(request, profile, src_layout)
        check_layout(request, profile, dst_layout)
        canonical = hf_parameters(hf_config(LAYOUT_MODELS[layout_model]))
        src = specs_or_skip(profile, layout_model, src_layout)
        dst = specs_or_skip(profile, layout_model, dst_layout)
        pair = f"{layout_id(src_layout)}->{layout_id(dst_layout)}"
        fail_listing(round_trip(src, dst, canonical), f"{profile.name} {layout_model} {pair}")


class Layer2FromTrainers(SuiteBase):
    """Layer 2 for rollout adapters: from every registered trainer layout."""

    @layer2
    def test_l2_from_trainer_layouts(self, profile, layout_model, trainer_layout, request):
        """Weights of a built-in trainer layout reshard exactly into every adapter layout.

        The source is a registered train engine's own `shard_layout` (FSDP dp shards,
        DTensor tp, Megatron tp/pp, DeepSpeed ZeRO-3 owners); trainer and rollout ranks
        coincide, as in a colocated run.
        """
        check_family(profile, layout_model)
        config = hf_config(LAYOUT_MODELS[layout_model])
        src = trainer_layout.specs(config)
        if src is None:
            pytest.skip(f"trainer {trainer_layout.id} refuses {layout_model}")
        canonical = hf_parameters(config)
        problems, tested = [], 0
        for layout in profile.layouts():
            if profile.missing_capability(layout):
                continue
            try:
                dst = layout_specs(profile.cls, config, layout)
            except ConfigError:
                continue
            tested += 1
            problems += [f"-> {layout_id(layout)}: {p}" for p in round_trip(src, dst, canonical)]
            if problems:
                break
        if not tested:
            pytest.skip(f"{profile.name} accepts no layout of {layout_model}")
        fail_listing(problems, f"{profile.name} {layout_model} from trainer {trainer_layout.id}")
