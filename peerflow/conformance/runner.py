"""Results of a suite run: per-test records, the table per layer and capability, JSON.

The pytest plugin registers a `ResultCollector` when `--peerflow-table` or
`--peerflow-report FILE` is given; at the end of the session it builds the report with
`build_report`, prints `format_report` and writes the JSON. `peerflow conformance NAME`
runs pytest on `cli_suite.py` that way, in a subprocess.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

OUTCOMES = ("passed", "failed", "skipped", "xfailed")
_CAPABILITY = re.compile(r"Capabilities\.(\w+)")


class ResultCollector:
    """pytest plugin object that records each suite test's result."""

    def __init__(self) -> None:
        self.tests: dict[str, dict[str, Any]] = {}
        self.layers: dict[str, int] = {}
        self.groups: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Records each selected suite test's layer and group (`core`, `lora`, …)."""
        from peerflow.conformance.pytest_plugin import suite_group

        for item in items:
            marker = item.get_closest_marker("peerflow_layer")
            self.layers[item.nodeid] = int(marker.args[0]) if marker else -1
            self.groups[item.nodeid] = suite_group(item)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Folds one setup/call/teardown report into the test's record."""
        entry = self.tests.setdefault(report.nodeid, {
            "id": report.nodeid.split("::", 1)[-1], "layer": self.layers.get(report.nodeid, -1),
            "group": self.groups.get(report.nodeid, "core"), "outcome": "passed",
            "capability": "-", "message": "", "duration_s": 0.0})
        entry["duration_s"] += report.duration
        for key, value in report.user_properties:
            if key == "capability" and entry["capability"] in ("-", "core"):
                entry["capability"] = value
        if report.when != "call" and report.outcome == "passed":
            return
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "failed"
            entry["message"] = f"xfail: {report.wasxfail}"
        elif report.skipped:
            entry["outcome"] = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
                report.longrepr)
            entry["message"] = reason.removeprefix("Skipped: ")
            found = _CAPABILITY.search(entry["message"])
            if found:
                entry["capability"] = found.group(1)
        elif report.failed:
            entry["outcome"] = "failed"
            entry["message"] = failure_message(report)[:3000]
        if report.when == "call" and report.outcome == "passed" and \
                entry["outcome"] != "failed":
            entry["outcome"] = "passed"


def failure_message(report: pytest.TestReport) -> str:
    """The assertion or `pytest.fail` message of a failed report (never the test source)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.removeprefix("Failed: ")
    return str(report.longrepr).strip().removeprefix("Failed: ")


def adapter_classes(name: str) -> list[tuple[str, type]]:
    """Returns `(kind, class)` for every registered engine called `name`.

    Raises:
        UnknownNameError: no rollout or train engine has that name.
    """
    from peerflow.plugins import get_plugin_manager

    pm = get_plugin_manager()
    found = [(kind, pm.registry(key).get(name))
             for kind, key in (("rollout", "rollout_engine"), ("train", "train_engine"))
             if name in pm.registry(key)]
    if not found:
        pm.registry("rollout_engine").get(name)  # raises the registry's message
    return found


def suite_device() -> str:
    """The device the suite's engines were built on, as the report names it.

    `emu:0 (emulated)` under `--emulate-device` (`PEERFLOW_EMULATE_ACCELERATOR=1`), so a
    green table on the emulated accelerator is never read as a GPU's or a CPU's.
    """
    import os

    from peerflow.distributed.devices import rank_device

    device = str(rank_device())
    if os.environ.get("PEERFLOW_EMULATE_ACCELERATOR") == "1":
        return f"{device} (emulated)"
    return device


def build_report(name: str | None, collector: ResultCollector, exit_code: int,
                 duration_s: float) -> dict[str, Any]:
    """Returns the machine-readable report of a finished suite run."""
    classes = adapter_classes(name) if name else []
    tests = sorted(collector.tests.values(), key=lambda t: (t["layer"], t["id"]))
    summary = Counter(t["outcome"] for t in tests)
    return {
        "adapter": name,
        "device": suite_device(),
        "engines": [{"kind": kind, "class": f"{cls.__module__}.{cls.__qualname__}",
                     "capabilities": cls.machine_capabilities().enabled()}
                    for kind, cls in classes],
        "passed": summary.get("failed", 0) == 0 and exit_code == 0 and bool(tests),
        "pytest_exit_code": exit_code,
        "duration_s": round(duration_s, 3),
        "summary": {k: summary.get(k, 0) for k in OUTCOMES},
        "layers": _table(tests),
        "tests": tests,
    }


def _table(tests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[int, str], Counter] = {}
    for t in tests:
        capability = t["capability"] if t["capability"] != "-" else "surface" \
            if t["layer"] == 0 else "core"
        if capability == "core" and t.get("group", "core") != "core":
            capability = t["group"]  # the generate contract's own row
        rows.setdefault((t["layer"], capability), Counter())[t["outcome"]] += 1
    return [{"layer": layer, "capability": cap, **{k: c.get(k, 0) for k in OUTCOMES}}
            for (layer, cap), c in sorted(rows.items())]


def format_report(report: dict[str, Any]) -> str:
    """Renders the results table (per layer and capability) and the failures."""
    lines = [f"peerflow conformance {report['adapter']} on {report.get('device', 'cpu')}"]
    for engine in report["engines"]:
        caps = ", ".join(engine["capabilities"]) or "none"
        lines.append(f"  {engine['kind']} engine {engine['class']}  capabilities: {caps}")
    header = f"{'layer':<6}{'capability':<26}" + "".join(f"{k:>9}" for k in OUTCOMES)
    lines += ["", header, "-" * len(header)]
    for row in report["layers"]:
        lines.append(f"{row['layer']:<6}{row['capability']:<26}" +
                     "".join(f"{row[k]:>9}" for k in OUTCOMES))
    total = report["summary"]
    lines.append("-" * len(header))
    lines.append(f"{'all':<32}" + "".join(f"{total[k]:>9}" for k in OUTCOMES))
    failures = [t for t in report["tests"] if t["outcome"] == "failed"]
    if failures:
        lines += ["", "failures:"]
        for t in failures:
            lines.append(f"  {t['id']}")
            lines += [f"      {line}" for line in t["message"].splitlines()[:12]]
        held = sum(t["outcome"] == "skipped" and "already failed at" in t["message"]
                   for t in report["tests"])
        if held:
            lines.append(f"  ({held} more tests of the same layer and group skipped; fix the "
                         "failures above first — other groups ran)")
    lines.append("")
    lines.append(("PASSED" if report["passed"] else "FAILED") +
                 f" in {report['duration_s']:.1f} s")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    """Writes the report as JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
