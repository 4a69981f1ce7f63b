"""pytest plugin of the PeerFlow conformance suite (`pytest11` entry point).

* `--peerflow-adapter NAME`: the registered engine the suite classes test when they do
  not set `adapter_class`.
* Parametrises suite tests by the adapter's layouts and the suite's model matrix.
* Applies the adapter's `conformance_xfail()` declarations as strict expected failures.
* Deselects suite classes of the other kind (a rollout adapter skips the train suite).
"""

from __future__ import annotations

import itertools

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    """Adds the `--peerflow-adapter` option."""
    group = parser.getgroup("peerflow", "PeerFlow adapter conformance suite")
    group.addoption("--peerflow-adapter", action="store", default=None, metavar="NAME",
                    help="registered engine adapter the conformance suite tests")


def pytest_configure(config: pytest.Config) -> None:
    """Registers the suite's markers."""
    config.addinivalue_line("markers", "peerflow_layer(n): PeerFlow conformance suite layer")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def _profile(cls: type, config: pytest.Config):
    from peerflow.conformance.base import resolve_adapter
    from peerflow.conformance.profile import AdapterProfile

    adapter = resolve_adapter(cls, config)
    return AdapterProfile.of(adapter) if adapter is not None else None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrises suite tests over models, layouts and layout pairs."""
    cls = metafunc.cls
    if cls is None or not getattr(cls, "_peerflow_suite", False):
        return
    from peerflow.conformance.models import ENGINE_MODELS, LAYOUT_MODELS
    from peerflow.conformance.profile import DEFAULT_LAYOUTS, layout_id

    profile = _profile(cls, metafunc.config)
    layouts = list(profile.layouts()) if profile is not None else list(DEFAULT_LAYOUTS)
    names = metafunc.fixturenames
    if "layout_model" in names:
        metafunc.parametrize("layout_model", list(LAYOUT_MODELS))
    if "layout" in names:
        metafunc.parametrize("layout", layouts, ids=[layout_id(x) for x in layouts])
    if "layout_pair" in names:
        pairs = list(itertools.product(layouts, layouts))
        metafunc.parametrize("layout_pair", pairs,
                             ids=[f"{layout_id(a)}-to-{layout_id(b)}" for a, b in pairs])
    if "engine_model" in names:
        metafunc.parametrize("engine_model", list(ENGINE_MODELS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects suites of the other kind and marks declared expected failures."""
    keep, drop = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not getattr(cls, "_peerflow_suite", False):
            keep.append(item)
            continue
        profile = _profile(cls, config)
        if profile is None and config.getoption("peerflow_adapter", None):
            drop.append(item)
            continue
        if profile is not None and cls.suite_kind and profile.kind != cls.suite_kind:
            drop.append(item)
            continue
        if profile is not None:
            name = item.originalname if hasattr(item, "originalname") else item.name
            reason = profile.xfail_reason(item.nodeid, name)
            if reason:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
