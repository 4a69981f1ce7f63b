"""GPU validation kit runner (standard library only; see docs/gpu-validation.md).

One call on a bare GPU machine (preinstalled CUDA PyTorch, no registry):

1. install from `--wheels DIR` only what the image lacks (`gpu_validate_wheels.plan_install`:
   an absent distribution, or one installed at a version that does not satisfy the kit or
   another wheel being installed), DeepSpeed from its source package with
   `DS_BUILD_OPS=0`, and PeerFlow itself from this checkout, never touching the image's
   torch or its own pytest, pluggy, attrs, … where they satisfy;
2. run the checks of `plan_checks` (programs: `gpu_validate_checks`, `peerflow`, pytest)
   phase after phase; inside a phase the lanes run side by side, each running its checks
   in order, every check as a subprocess (and its process group) under its own time
   budget; `realsize` and the coordinator benchmark each have a phase to themselves;
3. write `OUT/gpu-validate.json` (format: `gpu_validate_report`), `OUT/gpu-validate.log`
   (every command and its output) and `OUT/logs/<check>.log`.

`--dry-run` does everything that needs no GPU: checks the wheel folder against `WHEELS`
and the transfer limit, the commands, the plan's order and its time against the
10-minute command limit (`gpu_validate_report.plan_times`), and writes and validates a
report whose checks are all `planned`. `--prepare-wheels DIR` fills a wheel folder on a
CPU machine with a registry.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The kit's other modules sit beside it; found however this file is loaded.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_validate_checks import FIGURES_PREFIX, UNSUPPORTED_EXIT  # noqa: E402
from gpu_validate_plan import (  # noqa: E402
    Check,
    check_commands,
    order_problems,
    plan_checks,
)
from gpu_validate_report import (  # noqa: E402
    INSTALL_BUDGET_S,
    TOTAL_BUDGET_S,
    build_report,
    coordinator_figures,
    metrics_figures,
    plan_problems,
    plan_times,
    validate_report,
)
from gpu_validate_wheels import (  # noqa: E402
    ROOT,
    TRANSFER_LIMIT,
    WHEELS,
    check_wheel_folder,
    find_wheels,
    installed_distributions,
    norm,
    plan_install,
    prepare_wheels,
    satisfies,
)


@dataclass
class Runner:
    """Runs the install and the checks, logging every command (safe across lanes)."""

    out: Path
    wheels: Path
    log: Any = None
    start: float = field(default_factory=time.monotonic)
    lock: Any = field(default_factory=threading.Lock)

    def say(self, text: str) -> None:
        """Prints a line and writes it to the log."""
        with self.lock:
            print(text, flush=True)
            self.log.write(text.rstrip() + "\n")
            self.log.flush()

    def run(self, argv: list[str], budget: float, env: dict[str, str] | None = None,
            name: str = "") -> tuple[int | None, str, float]:
        """Runs a command in its own session; on timeout stops its whole process tree.

        Returns (exit status, or None on timeout; its output; seconds).
        """
        self.say(f"$ {' '.join(argv)}   # budget {budget:.0f} s")
        began = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                env=env, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=budget)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            stop_tree(proc.pid)
            try:
                output, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:  # a grandchild holds the pipe open
                output = ""
            code = None
            output = (output or "") + f"\n[timed out after {budget:.0f} s]"
        seconds = time.monotonic() - began
        if name:
            (self.out / "logs").mkdir(exist_ok=True)
            (self.out / "logs" / f"{name}.log").write_text(output)
        with self.lock:
            self.log.write(f"--- {name or argv[0]} ({seconds:.1f} s, exit {code})\n"
                           f"{output}\n")
            self.log.flush()
        return code, output, seconds

    def left(self) -> float:
        """Seconds left of the kit's total budget."""
        return TOTAL_BUDGET_S - (time.monotonic() - self.start)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_tree(pid: int) -> None:
    """Kills a process, its process group and every descendant (in any session)."""
    victims = _descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for child in [pid, *victims]:
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass


def install(runner: Runner, folder: dict[str, Any]) -> tuple[dict[str, Any],
                                                             dict[str, list[str]]]:
    """Installs what the image lacks from the wheel folder, then PeerFlow (no index).

    Returns the install entry and, per wheel group, what is still unavailable.
    """
    files = find_wheels(runner.wheels)
    before = installed_distributions()
    plan = plan_install(files, before)
    chosen = [files[n] for n in sorted(plan.install)]
    runner.say(f"installing {len(chosen)} of {len(files)} files (the image has the rest): "
               + ", ".join(f"{n} ({why})" for n, why in sorted(plan.install.items())))
    for line in plan.unsatisfied:
        runner.say(f"unsatisfied: {line}")
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
           "--no-build-isolation", "--disable-pip-version-check", "-q"]
    env = dict(os.environ, DS_BUILD_OPS="0")
    wheels = [str(p) for p in chosen if p.suffix == ".whl"]
    sources = [str(p) for p in chosen if p.suffix != ".whl"]
    steps: list[tuple[str, int | None, str, float]] = []
    for label, argv, share in (("wheels", wheels, 1 / 3), ("sources", sources, 1 / 2)):
        if argv:
            code, out, s = runner.run([*pip, *argv], INSTALL_BUDGET_S * share, env, label)
            steps.append((label, code, out, s))
    code, out, s = runner.run([*pip, "-e", str(ROOT)], INSTALL_BUDGET_S / 6, env, "peerflow")
    steps.append(("peerflow", code, out, s))
    after = installed_distributions()
    unavailable = {group: [w.name for w in items
                           if not satisfies(after.get(norm(w.name)), w.need)]
                   for group, items in WHEELS.items()}
    unavailable = {g: m for g, m in unavailable.items() if m}
    ok = all(code == 0 for _, code, _, _ in steps)
    entry = {**folder, "status": "passed" if ok else "failed",
             "seconds": round(sum(s for *_, s in steps), 1),
             "steps": {label: {"returncode": code, "seconds": round(s, 1)}
                       for label, code, _, s in steps},
             "installed": plan.install, "kept": plan.kept, "unsatisfied": plan.unsatisfied,
             "unavailable": unavailable,
             "errors": [out[-2000:] for _, code, out, _ in steps if code != 0]}
    return entry, unavailable


def _entry(check: Check, status: str) -> dict[str, Any]:
    return {"name": check.name, "proves": check.proves, "budget_s": check.budget_s,
            "phase": check.phase, "lane": check.lane, "command": ["python", *check.argv],
            "status": status, "seconds": 0.0, "returncode": None, "figures": {},
            "log_tail": ""}


def run_check(runner: Runner, check: Check, missing: dict[str, list[str]],
              done: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Runs one check within its budget and returns its report entry."""
    entry = _entry(check, "skipped")
    lacking = [g for g in check.needs if missing.get(g)]
    if lacking:
        entry["figures"] = {"reason": f"wheels missing for {', '.join(lacking)}: "
                            + ", ".join(n for g in lacking for n in missing[g])}
        return entry
    for name in check.requires:
        status = (done or {}).get(name, {}).get("status", "not run")
        if status != "passed":
            entry["figures"] = {"reason": f"needs {name} to pass first ({status})"}
            return entry
    if runner.left() < check.budget_s:
        entry["figures"] = {"reason": f"out of time ({runner.left():.0f} s left)"}
        return entry
    env = dict(os.environ, HF_HUB_OFFLINE="1", OUT=str(runner.out))
    code, output, seconds = runner.run([sys.executable, *check.argv], check.budget_s, env,
                                       check.name)
    figures: dict[str, Any] = {}
    for line in output.splitlines():
        if line.startswith(FIGURES_PREFIX):
            figures.update(json.loads(line[len(FIGURES_PREFIX):]))
    if check.run_dir:
        figures.update(metrics_figures(Path(check.run_dir)))
    if check.bench_json:
        figures.update(coordinator_figures(Path(check.bench_json)))
    status = {None: "timeout", 0: "passed", UNSUPPORTED_EXIT: "unsupported"}.get(code, "failed")
    entry.update(status=status, seconds=round(seconds, 1), returncode=code, figures=figures,
                 log_tail=output[-1500:])
    runner.say(f"[{status}] {check.name} ({entry['seconds']} s) "
               f"{json.dumps(figures)[:600]}")
    return entry


def run_phases(runner: Runner, checks: list[Check], missing: dict[str, list[str]]
               ) -> list[dict[str, Any]]:
    """Runs the checks phase after phase, the lanes of a phase side by side."""
    done: dict[str, dict[str, Any]] = {}

    def lane(items: list[Check]) -> None:
        for check in items:
            entry = done[check.name] = run_check(runner, check, missing, done)
            if entry["status"] == "skipped":
                runner.say(f"[skipped] {check.name}: {entry['figures']['reason']}")

    for phase in sorted({c.phase for c in checks}):
        lanes: dict[str, list[Check]] = {}
        for check in checks:
            if check.phase == phase:
                lanes.setdefault(check.lane, []).append(check)
        threads = [threading.Thread(target=lane, args=(items,), name=f"lane-{name}")
                   for name, items in lanes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        runner.say(f"phase {phase} ({', '.join(lanes)}) done at "
                   f"{time.monotonic() - runner.start:.0f} s")
    return [done[c.name] for c in checks]


def main(argv: list[str] | None = None) -> int:
    """Runs the kit; returns the exit status (0: every check passed or was planned)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default="wheels", help="local wheel folder")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-validate",
                        help="where the report and log go (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="plan and check, run nothing")
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--prepare-wheels", metavar="DIR", help="download the wheels")
    args = parser.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(Path(args.prepare_wheels))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wheels = Path(args.wheels).resolve()
    checks = plan_checks(out)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in checks}
        if unknown:
            parser.error(f"--only: unknown checks {sorted(unknown)}; known: "
                         f"{[c.name for c in checks]}")
        checks = [c for c in checks if c.name in wanted]
    with open(out / "gpu-validate.log", "w") as log:
        runner = Runner(out=out, wheels=wheels, log=log)
        folder = check_wheel_folder(wheels)
        runner.say(f"wheel folder {wheels}: {len(folder['files'])} files, "
                   f"{folder['bytes'] / 2**20:.1f} MiB (+ tree {folder['tree_bytes'] / 2**20:.1f}"
                   f" MiB; limit {TRANSFER_LIMIT // 2**20} MiB); missing: {folder['missing']}")
        plan = plan_times([{"phase": c.phase, "lane": c.lane, "budget_s": c.budget_s}
                           for c in checks])
        for row in plan["phases"]:
            runner.say(f"phase {row['phase']}: {row['budget_s']} s, lanes {row['lanes']}")
        runner.say(f"install {plan['install_s']} s + phases = {plan['total_s']} s "
                   f"(kit limit {plan['limit_s']} s, command limit {plan['command_limit_s']} s)")
        problems = plan_problems(plan) + check_commands(checks) + order_problems(checks)
        if args.dry_run:
            install_entry = {**folder, "status": "planned", "seconds": 0.0, "errors": []}
            entries = [_entry(c, "planned") for c in checks]
            for c in checks:
                runner.say(f"[plan] {c.phase}{c.lane} {c.name:<22} {c.budget_s:>3} s  "
                           f"python {' '.join(c.argv)}")
            device = None
            if not folder["fits_transfer_limit"]:
                problems.append("the wheel folder and the tree exceed the transfer limit")
        else:
            install_entry, unavailable = install(runner, folder)
            entries = run_phases(runner, checks, unavailable)
            device = next((e["figures"] for e in entries if e["name"] == "env"), None)
        report = build_report(args.dry_run, install_entry, entries, device)
        problems += validate_report(report)
        for problem in dict.fromkeys(problems):
            runner.say(f"report problem: {problem}")
    (out / "gpu-validate.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out / 'gpu-validate.json'}; log: {out / 'gpu-validate.log'}")
    failed = [e["name"] for e in entries if e["status"] in ("failed", "timeout")]
    return 1 if problems or failed else 0


if __name__ == "__main__":
    sys.exit(main())
