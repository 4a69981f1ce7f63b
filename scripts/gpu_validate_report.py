"""The GPU validation kit's report: its format, its validator and a run's figures.

`OUT/gpu-validate.json` holds the schema, whether it was a dry run, the device, the
budget, the install entry, one entry per check (status one of `STATUSES`) and a summary
of statuses. The same validator accepts a dry run's report and a real one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

SCHEMA = "peerflow-gpu-validate/1"
#: Seconds the whole kit may take (a device command may run 600 s).
TOTAL_BUDGET_S = 540
#: Seconds reserved for installing the wheels and PeerFlow.
INSTALL_BUDGET_S = 90
STATUSES = ("planned", "passed", "failed", "timeout", "skipped", "unsupported")


def validate_report(report: dict[str, Any]) -> list[str]:
    """Problems with a report's format (empty when valid)."""
    problems = []
    for key, kind in (("schema", str), ("dry_run", bool), ("budget_s", int),
                      ("install", dict), ("checks", list), ("summary", dict)):
        if not isinstance(report.get(key), kind):
            problems.append(f"report[{key!r}] must be a {kind.__name__}")
    if report.get("schema") != SCHEMA:
        problems.append(f"report['schema'] must be {SCHEMA!r}")
    total = 0
    for i, check in enumerate(report.get("checks") or []):
        for key, kind in (("name", str), ("proves", str), ("budget_s", int),
                          ("command", list), ("status", str), ("figures", dict)):
            if not isinstance(check.get(key), kind):
                problems.append(f"checks[{i}][{key!r}] must be a {kind.__name__}")
        if check.get("status") not in STATUSES:
            problems.append(f"checks[{i}]['status']={check.get('status')!r}: not one of "
                            f"{STATUSES}")
        total += check.get("budget_s") or 0
    if total + INSTALL_BUDGET_S > TOTAL_BUDGET_S:
        problems.append(f"check budgets ({total} s) + install ({INSTALL_BUDGET_S} s) exceed "
                        f"{TOTAL_BUDGET_S} s")
    return problems


def metrics_figures(run_dir: Path) -> dict[str, Any]:
    """Reward first/last steps, log-prob mismatch and step time from a run's metrics."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return {}

    def mean(key: str, part: list[dict[str, Any]]) -> float | None:
        values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return round(sum(values) / len(values), 4) if values else None

    head, tail = rows[:5], rows[-5:]
    figures = {"steps": rows[-1].get("step"), "reward_first5": mean("reward/mean", head),
               "reward_last5": mean("reward/mean", tail),
               "time_step_s": mean("time/step", tail),
               "tokens_per_s": mean("throughput/tokens_per_s", tail)}
    for key in sorted({k for r in rows for k in r if "mismatch" in k}):
        figures[key] = mean(key, tail)
    return figures


def build_report(dry_run: bool, install_entry: dict[str, Any], checks: list[dict[str, Any]],
                 device: dict[str, Any] | None) -> dict[str, Any]:
    """The report of one kit run (format: `validate_report`)."""
    counts: dict[str, int] = {}
    for c in checks:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "dry_run": dry_run, "device": device, "budget_s": TOTAL_BUDGET_S,
            "install": install_entry, "checks": checks, "summary": counts}
