"""pytest plugin of the PeerFlow conformance suite (`pytest11` entry point).

* `--peerflow-adapter NAME`: the registered engine the suite classes test when they do
  not set `adapter_class`.
* Parametrises suite tests by the adapter's layouts and the suite's model matrix.
* Applies the adapter's `conformance_xfail()` declarations as strict expected failures.
* Deselects suite classes of the other kind (a rollout adapter skips the train suite).
* Skips the rest of a layer's group of a suite class after its first failure, so one root
  cause gives one failure (`--peerflow-all-failures` runs everything). A group is the
  core contract of a layer, or one optional part of it (`peerflow_group("lora")`,
  `peerflow_group("generate")`): a failure in one group never skips another, so an
  optional capability's failure leaves the core tests run and reported.
* `--peerflow-table` prints a results table per layer and capability at the end;
  `--peerflow-report FILE` writes the same as JSON (what `peerflow conformance` uses).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

_COLLECTOR = pytest.StashKey[object]()
_FIRST_FAILURES = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """Adds the `--peerflow-adapter` option."""
    group = parser.getgroup("peerflow", "PeerFlow adapter conformance suite")
    group.addoption("--peerflow-adapter", action="store", default=None, metavar="NAME",
                    help="registered engine adapter the conformance suite tests")
    group.addoption("--peerflow-all-failures", action="store_true", default=False,
                    help="run every test of a layer even after one failed (by default the "
                    "rest of a layer is skipped after its first failure: one root cause, one "
                    "failure)")
    group.addoption("--peerflow-table", action="store_true", default=False,
                    help="print the conformance results table per layer and capability")
    group.addoption("--peerflow-report", action="store", default=None, metavar="FILE",
                    help="write the conformance results as JSON")


def pytest_configure(config: pytest.Config) -> None:
    """Registers the suite's markers and, when asked, the results collector."""
    config.addinivalue_line("markers", "peerflow_layer(n): PeerFlow conformance suite layer")
    config.addinivalue_line("markers", "peerflow_group(name): a part of a conformance layer "
                            "whose failures skip only that part (default: core)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    if config.getoption("peerflow_table") or config.getoption("peerflow_report"):
        from peerflow.conformance.runner import ResultCollector

        collector = ResultCollector()
        config.stash[_COLLECTOR] = (collector, time.perf_counter(), {})
        config.pluginmanager.register(collector, "peerflow-conformance-results")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Builds the results report and writes `--peerflow-report`."""
    entry = session.config.stash.get(_COLLECTOR, None)
    if entry is None:
        return
    from peerflow.conformance.runner import build_report, write_json

    collector, start, holder = entry
    report = build_report(session.config.getoption("peerflow_adapter"), collector,
                          int(exitstatus), time.perf_counter() - start)
    holder["report"] = report
    path = session.config.getoption("peerflow_report")
    if path:
        write_json(report, path)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Prints the results table (`--peerflow-table`)."""
    entry = config.stash.get(_COLLECTOR, None)
    if entry is None or not config.getoption("peerflow_table") or "report" not in entry[2]:
        return
    from peerflow.conformance.runner import format_report

    terminalreporter.write_line("")
    for line in format_report(entry[2]["report"]).splitlines():
        terminalreporter.write_line(line)


def suite_group(item: pytest.Item) -> str:
    """The part of its layer a suite test belongs to: `core`, or its `peerflow_group`."""
    marker = item.get_closest_marker("peerflow_group")
    return str(marker.args[0]) if marker is not None else "core"


def _layer_key(item: pytest.Item) -> tuple[type, int, str] | None:
    cls = getattr(item, "cls", None)
    marker = item.get_closest_marker("peerflow_layer")
    if cls is None or marker is None or not getattr(cls, "_peerflow_suite", False):
        return None
    return cls, int(marker.args[0]), suite_group(item)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips the rest of a layer's group after its first failure.

    Only tests of the same suite class, layer and group are skipped
    (`--peerflow-all-failures` runs them all).
    """
    key = _layer_key(item)
    first = item.config.stash.get(_FIRST_FAILURES, {}).get(key) if key else None
    if first is not None:
        part = "" if key[2] == "core" else f" ({key[2]})"
        pytest.skip(f"layer {key[1]}{part} already failed at {first}; fix that first (one "
                    "root cause, one failure; --peerflow-all-failures runs the rest)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Remembers the first real failure of each suite class, layer and group."""
    report = yield
    key = _layer_key(item)
    if key is not None and report.failed and not hasattr(report, "wasxfail") and \
            not item.config.getoption("peerflow_all_failures"):
        item.config.stash.setdefault(_FIRST_FAILURES, {}).setdefault(
            key, item.nodeid.split("::", 1)[-1])
    return report


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
    if "trainer_layout" in names:
        from peerflow.conformance.trainers import trainer_layouts

        trainers = trainer_layouts()
        metafunc.parametrize("trainer_layout", trainers, ids=[t.id for t in trainers])
    if "engine_model" in names:
        metafunc.parametrize("engine_model", list(ENGINE_MODELS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects suites of the other kind and impossible combinations; marks xfails.

    A combination is impossible when the adapter's declarations rule it out before any
    engine starts: a layout needing a capability it does not declare, or a model family
    missing from its `conformance_families()`. Those are not collected in a plain pytest
    run (a skip per combination made 41 % of a run's items skips); under `peerflow
    conformance` they are kept, so its report table names each undeclared capability.
    """
    keep, drop = [], []
    reported = config.stash.get(_COLLECTOR, None)  # the report table lists every skip
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
        if profile is not None and reported is None and _impossible(profile, item):
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


def _impossible(profile: Any, item: pytest.Item) -> bool:
    """Whether the adapter's declarations rule the item's parameters out."""
    from peerflow.conformance.models import model_family

    params = getattr(getattr(item, "callspec", None), "params", {})
    layouts = [params["layout"]] if "layout" in params else []
    layouts += list(params.get("layout_pair", ()))
    if any(profile.missing_capability(layout) for layout in layouts):
        return True
    families = profile.families()
    if families is None:
        return False
    return any(model_family(params[key]) not in families
               for key in ("layout_model", "engine_model") if key in params)
