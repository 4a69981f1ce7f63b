"""The GPU validation kit's report: its format, its validator, its time plan, a run's figures.

`OUT/gpu-validate.json` holds the schema, whether it was a dry run, the device, the time
plan (`plan_times`), the install entry, one entry per check (status one of `STATUSES`,
with its phase and lane) and a summary of statuses. The same validator accepts a dry
run's report and a real one.

Time plan: the checks run in phases, one after the other; inside a phase each lane runs
its checks in order while the lanes run side by side. A phase takes at most its longest
lane's summed budgets; the install plus every phase must stay under `TOTAL_BUDGET_S`,
which leaves a margin to the device's 10-minute command limit (`COMMAND_LIMIT_S`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA = "peerflow-gpu-validate/2"
#: Seconds one device command may run.
COMMAND_LIMIT_S = 600
#: Seconds the whole kit may take: the command limit less a margin for the interpreter's
#: start, the report and stopping what overran.
TOTAL_BUDGET_S = 560
#: Seconds reserved for installing the wheels, DeepSpeed's build and PeerFlow
#: (measured on the H200, 2026-11-27: 4-5 s, 14-18 s and 2-3 s).
INSTALL_BUDGET_S = 60
STATUSES = ("planned", "passed", "failed", "timeout", "skipped", "unsupported")


def plan_times(entries: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Each phase's lanes (summed budgets) and bound, and the kit's total.

    `entries`: report entries (or dicts) that carry `phase`, `lane` and `budget_s`.
    """
    phases: dict[int, dict[str, int]] = {}
    for e in entries:
        lanes = phases.setdefault(int(e["phase"]), {})
        lanes[e["lane"]] = lanes.get(e["lane"], 0) + int(e["budget_s"])
    rows = [{"phase": p, "lanes": lanes, "budget_s": max(lanes.values())}
            for p, lanes in sorted(phases.items())]
    return {"install_s": INSTALL_BUDGET_S, "phases": rows,
            "total_s": INSTALL_BUDGET_S + sum(r["budget_s"] for r in rows),
            "limit_s": TOTAL_BUDGET_S, "command_limit_s": COMMAND_LIMIT_S}


def validate_report(report: dict[str, Any]) -> list[str]:
    """Problems with a report's format and time plan (empty when valid)."""
    problems = []
    for key, kind in (("schema", str), ("dry_run", bool), ("budget_s", int),
                      ("install", dict), ("checks", list), ("summary", dict), ("plan", dict)):
        if not isinstance(report.get(key), kind):
            problems.append(f"report[{key!r}] must be a {kind.__name__}")
    if report.get("schema") != SCHEMA:
        problems.append(f"report['schema'] must be {SCHEMA!r}")
    checks = report.get("checks") or []
    ok = True
    for i, check in enumerate(checks):
        for key, kind in (("name", str), ("proves", str), ("budget_s", int), ("phase", int),
                          ("lane", str), ("command", list), ("status", str),
                          ("figures", dict)):
            if not isinstance(check.get(key), kind):
                problems.append(f"checks[{i}][{key!r}] must be a {kind.__name__}")
                ok = False
        if check.get("status") not in STATUSES:
            problems.append(f"checks[{i}]['status']={check.get('status')!r}: not one of "
                            f"{STATUSES}")
    if ok:
        problems += plan_problems(plan_times(checks))
    return problems


def plan_problems(plan: dict[str, Any]) -> list[str]:
    """Problems with a time plan (`plan_times`): over the kit's total or the command limit."""
    problems = []
    lanes = "; ".join(f"phase {r['phase']}: {r['budget_s']} s (lanes {r['lanes']})"
                      for r in plan["phases"])
    if plan["total_s"] > TOTAL_BUDGET_S:
        problems.append(f"the plan takes {plan['total_s']} s (install {INSTALL_BUDGET_S} s; "
                        f"{lanes}), over the kit's {TOTAL_BUDGET_S} s")
    if TOTAL_BUDGET_S > COMMAND_LIMIT_S:
        problems.append(f"TOTAL_BUDGET_S {TOTAL_BUDGET_S} exceeds the command limit "
                        f"{COMMAND_LIMIT_S} s")
    return problems


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's `metrics.jsonl` (empty when there is none)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


#: Metrics a train check reports besides rewards and step time (means of the last 5 steps):
#: async staleness and overlap, and what each coordinator route moved.
TAIL_PREFIXES = ("staleness/mean", "staleness/max", "overlap/", "coordinator/")


def metrics_figures(run_dir: Path) -> dict[str, Any]:
    """A train run's figures from its metrics.

    Reward over the first and last 5 steps, log-prob mismatch, step time, async
    staleness and overlap, and what each coordinator route moved.
    """
    rows = metrics_rows(run_dir)
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
    for key in sorted({k for r in rows for k in r if "mismatch" in k
                       or k.startswith(TAIL_PREFIXES)}):
        figures[key] = mean(key, tail)
    return figures


def coordinator_figures(path: Path) -> dict[str, Any]:
    """The headline of `peerflow bench coordinator --json`.

    Per process count the p2p vs centralized ratios, and the cores the machine had.
    """
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    keep = ("wall_p2p_over_centralized", "busiest_bytes_centralized_over_p2p", "cpu_ratio",
            "transport")
    ratios = {n: {k: v for k, v in r.items() if k in keep}
              for n, r in (data.get("ratios") or {}).items()}
    return {"cpu_count": data.get("cpu_count"), "median_of": data.get("median_of"),
            "ratios": ratios}


def build_report(dry_run: bool, install_entry: dict[str, Any], checks: list[dict[str, Any]],
                 device: dict[str, Any] | None) -> dict[str, Any]:
    """The report of one kit run (format: `validate_report`)."""
    counts: dict[str, int] = {}
    for c in checks:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "dry_run": dry_run, "device": device, "budget_s": TOTAL_BUDGET_S,
            "plan": plan_times(checks), "install": install_entry, "checks": checks,
            "summary": counts}
