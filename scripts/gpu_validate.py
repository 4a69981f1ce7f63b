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
import re
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

from gpu_validate_checks import CHECKS, FIGURES_PREFIX, UNSUPPORTED_EXIT  # noqa: E402
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
class Check:
    """One validation step: a command, what passing it proves, its time budget and place."""

    name: str
    proves: str
    budget_s: int
    argv: list[str]
    lane: str
    """Checks of one lane run in order; the lanes of a phase run side by side."""
    phase: int = 0
    measured_s: float | None = None
    """Its longest time on the H200 (2026-11-27, run1-run3) where it ran to its end; the
    budget is about 1.6 times that. None: it never completed there (budget estimated)."""
    needs: tuple[str, ...] = ()
    """Wheel groups it needs (skipped with the reason when one is unavailable)."""
    requires: tuple[str, ...] = ()
    """Checks that must have passed before it (earlier in its lane or an earlier phase)."""
    run_dir: str | None = None
    """A `peerflow train` run directory whose metrics become figures."""
    bench_json: str | None = None
    """A `peerflow bench coordinator --json` file whose ratios become figures."""


def _train(run: str, steps: int, *sets: str, resume: bool = False, nprocs: int = 1
           ) -> list[str]:
    common = ["--set", f"run.steps={steps}", "--set", "run.tensorboard=false",
              "--set", "run.trace=false", *[a for s in sets for a in ("--set", s)]]
    if resume:
        return ["-m", "peerflow", "train", "--resume", run, *common]
    return ["-m", "peerflow", "train", "examples/quickstart.yaml", "--nprocs", str(nprocs),
            "--run-dir", run, *common]


#: Split placement with one rank per role: rank 0 generates, rank 1 trains.
SPLIT = ("runtime.placement=split", "rollout.layout.dp=1", "trainer.layout.dp=1")


def plan_checks(out: Path) -> list[Check]:
    """The checks, in lane order; run directories go under `out`.

    Phase 0 runs five lanes side by side (about 96-114 s for lanes A-C on the H200);
    phase 1 is `realsize` alone (the GPU to itself); phase 2 the coordinator benchmark
    alone (a core per process).
    """
    runs = out / "runs"
    q = str(runs / "quickstart-bf16")
    checks = "scripts/gpu_validate_checks.py"
    return [
        # lane A: versions, the gpu-marked tests, conformance of the reference adapters
        Check("env", "torch sees the GPU; versions of torch, CUDA, NCCL, engines", 30,
              [checks, "env"], "A", measured_s=16.1),
        Check("conformance_hf", "conformance layers 1-4 for the hf rollout adapter (layer 4 "
              "runs only with CUDA)", 50, ["-m", "peerflow", "conformance", "hf"], "A",
              measured_s=30.4, needs=("tests",)),
        Check("conformance_fsdp", "conformance layers 1-4 for the fsdp (FSDP2) trainer", 45,
              ["-m", "peerflow", "conformance", "fsdp"], "A", measured_s=26.8,
              needs=("tests",)),
        Check("gpu_tests", "every test marked `gpu` passes (CUDA paths of the adapters, "
              "reshard executor on CUDA)", 45,
              ["-m", "pytest", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider", "tests"],
              "A", measured_s=27.8, needs=("tests",)),
        # lane B: one process in bf16, its resume, two processes without a trainer
        Check("quickstart_bf16", "hf + fsdp (FSDP2) in bf16 on CUDA learn the quickstart; "
              "rollout-vs-trainer log-prob mismatch per step", 90,
              _train(q, 40, "model.dtype=bfloat16", "run.checkpoint_every=20"), "B",
              run_dir=q),
        Check("resume", "--resume continues the bf16 run from its step-40 checkpoint", 50,
              _train(q, 45, resume=True), "B", requires=("quickstart_bf16",), run_dir=q),
        Check("nccl_pair", "the NCCL collectives the runtime uses, two processes on one GPU "
              "(or NCCL's reason why not)", 20, [checks, "nccl-pair"], "B", measured_s=9.0),
        Check("cuda_ipc_pair", "the cuda_ipc weight transport between two processes on one "
              "GPU, time split plan/pack/wire/load", 20, [checks, "ipc-pair"], "B",
              measured_s=10.4),
        # lane C: DeepSpeed, then async streaming with two ranks
        Check("deepspeed_zero3", "DeepSpeed ZeRO-3 trains the quickstart on one GPU", 60,
              _train(str(runs / "ds"), 8, "trainer.backend=deepspeed",
                     "trainer.deepspeed.zero_stage=3"), "C",
              needs=("deepspeed",), run_dir=str(runs / "ds")),
        Check("conformance_deepspeed", "conformance layers 1-4 for DeepSpeed", 55,
              ["-m", "peerflow", "conformance", "deepspeed"], "C", measured_s=32.8,
              needs=("tests", "deepspeed")),
        Check("async_pair", "async mode (runtime.mode=async, split: rank 0 generates, rank 1 "
              "trains) with 2 processes on one GPU: groups stream, weights are pushed, "
              "staleness stays bounded", 60,
              _train(str(runs / "async"), 3, "runtime.mode=async", *SPLIT, nprocs=2), "C",
              run_dir=str(runs / "async")),
        # lane D: Megatron, then split placement with two ranks
        Check("megatron", "Megatron-core (distributed optimizer) trains the quickstart on one "
              "GPU", 60, _train(str(runs / "mg"), 8, "trainer.backend=megatron",
                                "trainer.megatron.use_distributed_optimizer=true"), "D",
              needs=("megatron",), run_dir=str(runs / "mg")),
        Check("conformance_megatron", "conformance layers 1-4 for Megatron-core", 55,
              ["-m", "peerflow", "conformance", "megatron"], "D", measured_s=32.7,
              needs=("tests", "megatron")),
        Check("split_pair", "split placement (rollout on rank 0, trainer on rank 1) with 2 "
              "processes on one GPU: route, weight sync across ranks", 60,
              _train(str(runs / "split"), 3, *SPLIT, nprocs=2), "D",
              run_dir=str(runs / "split")),
        # lane E: two ranks sharing the GPU (device tensors over gloo, by the device contract)
        Check("quickstart_dp2", "the quickstart colocated with dp = 2, both ranks on one GPU "
              "(FSDP2's collectives and the rebalance route over gloo)", 60,
              _train(str(runs / "dp2"), 3, nprocs=2), "E", run_dir=str(runs / "dp2")),
        Check("coordinator_pair", "the coordinator's rollout -> actor route between roles "
              "over torch.distributed (runtime.coordinator_transport=gloo; `auto` picks "
              "shared memory on one host), 2 processes on one GPU", 60,
              _train(str(runs / "coordinator"), 3, *SPLIT,
                     "runtime.coordinator_transport=gloo", nprocs=2), "E",
              run_dir=str(runs / "coordinator")),
        # phase 1: alone on the GPU
        Check("realsize", "a Qwen2.5-1.5B-shaped model (random weights, bf16): generate / "
              "train / weight-sync seconds, train MFU, peak GPU memory, ~512-token prompts "
              "and ~1024-token answers", 240, [checks, "realsize"], "R", phase=1),
        # phase 2: alone on the CPUs (CPU-only; 8 processes want 8 idle cores)
        Check("bench_coordinator", "peer-to-peer vs centralized data routing at 2, 4 and 8 "
              "processes with a core per process (`peerflow bench coordinator`)", 60,
              ["-m", "peerflow", "bench", "coordinator", "--nprocs", "2,4,8", "--runs", "7",
               "--json", str(out / "bench-coordinator.json")], "S", phase=2,
              bench_json=str(out / "bench-coordinator.json")),
    ]


def check_commands(checks: list[Check]) -> list[str]:
    """Problems with the checks' commands: unknown programs, subcommands or files."""
    problems = []
    for check in checks:
        argv = check.argv
        if argv[0].endswith(".py"):
            if len(argv) != 2 or argv[1] not in CHECKS:
                problems.append(f"{check.name}: {argv[1:]} is not a check of {argv[0]}")
        elif argv[:2] == ["-m", "peerflow"]:
            cli = ROOT / "peerflow" / "cli" / f"{argv[2]}_cmd.py"
            if not cli.is_file():
                problems.append(f"{check.name}: `peerflow {argv[2]}` does not exist")
            elif argv[2] == "bench" and not re.search(rf'^\s*"{re.escape(argv[3])}":',
                                                      cli.read_text(), re.M):
                problems.append(f"{check.name}: `peerflow bench {argv[3]}` does not exist")
            problems += [f"{check.name}: {a} does not exist" for a in argv
                         if a.endswith(".yaml") and not (ROOT / a).is_file()]
        elif argv[:2] != ["-m", "pytest"]:
            problems.append(f"{check.name}: unexpected command {argv}")
    return problems


def order_problems(checks: list[Check]) -> list[str]:
    """Problems with the plan's structure: names, lanes, what must run before what."""
    problems = []
    seen: dict[str, Check] = {}
    for check in checks:
        if check.name in seen:
            problems.append(f"{check.name}: planned twice")
        for name in check.requires:
            before = seen.get(name)
            if before is None:
                if any(c.name == name for c in checks):
                    problems.append(f"{check.name}: requires {name}, planned after it")
            elif not (before.phase < check.phase or (before.phase == check.phase
                                                     and before.lane == check.lane)):
                problems.append(f"{check.name}: requires {name}, which runs beside it "
                                f"(lane {before.lane}), not before it")
        seen[check.name] = check
    for phase in {c.phase for c in checks}:
        lanes = [c.lane for c in checks if c.phase == phase]
        for lane in set(lanes):
            if any(c.lane == lane and c.phase != phase for c in checks):
                problems.append(f"lane {lane} appears in several phases")
    return problems


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
