"""GPU validation kit runner (standard library only; see docs/gpu-validation.md).

One call on a bare GPU machine (preinstalled CUDA PyTorch, no registry):

1. install the wheels of `--wheels DIR` (`gpu_validate_wheels`: PeerFlow's small
   pure-Python dependencies, the test tools, DeepSpeed's source package and
   Megatron-core) and PeerFlow itself from this checkout, without touching the image's
   torch;
2. run every check of `plan_checks` (programs: `gpu_validate_checks`) as a subprocess
   under its own time budget (the budgets and the install add up to less than
   `TOTAL_BUDGET_S`, inside a 10-minute device command);
3. write `OUT/gpu-validate.json` (format: `gpu_validate_report`) and
   `OUT/gpu-validate.log` (every command and its output).

`--dry-run` does everything that needs no GPU: checks the wheel folder against `WHEELS`
(`gpu_validate_wheels`) and the transfer limit, the plan against the time budget, and
writes and validates a report whose checks are all `planned`. `--prepare-wheels DIR`
fills a wheel folder on a CPU machine with a registry.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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
    metrics_figures,
    validate_report,
)
from gpu_validate_wheels import (  # noqa: E402
    ROOT,
    TRANSFER_LIMIT,
    check_wheel_folder,
    prepare_wheels,
)


@dataclass
class Check:
    """One validation step: a command, what passing it proves, and its time budget."""

    name: str
    proves: str
    budget_s: int
    argv: list[str]
    needs: tuple[str, ...] = ()
    """Wheel groups it needs (skipped with the reason when one is missing)."""
    run_dir: str | None = None
    """A `peerflow train` run directory whose metrics become figures."""


def _train(run: str, steps: int, *sets: str, resume: bool = False) -> list[str]:
    common = ["--set", f"run.steps={steps}", "--set", "run.tensorboard=false",
              "--set", "run.trace=false", *[a for s in sets for a in ("--set", s)]]
    if resume:
        return ["-m", "peerflow", "train", "--resume", run, *common]
    return ["-m", "peerflow", "train", "examples/quickstart.yaml", "--nprocs", "1",
            "--run-dir", run, *common]


def plan_checks(out: Path) -> list[Check]:
    """The checks, in order; run directories go under `out`."""
    q = str(out / "runs" / "quickstart-bf16")
    checks = "scripts/gpu_validate_checks.py"
    return [
        Check("env", "torch sees the GPU; versions of torch, CUDA, NCCL, engines", 10,
              [checks, "env"]),
        Check("gpu_tests", "every test marked `gpu` passes (CUDA paths of the adapters, "
              "reshard executor on CUDA)", 40,
              ["-m", "pytest", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider", "tests"],
              needs=("tests",)),
        Check("conformance_hf", "conformance layers 1-4 for the hf rollout adapter (layer 4 "
              "runs only with CUDA)", 20, ["-m", "peerflow", "conformance", "hf"],
              needs=("tests",)),
        Check("conformance_fsdp", "conformance layers 1-4 for the fsdp (FSDP2) trainer", 20,
              ["-m", "peerflow", "conformance", "fsdp"], needs=("tests",)),
        Check("conformance_deepspeed", "conformance layers 1-4 for DeepSpeed", 20,
              ["-m", "peerflow", "conformance", "deepspeed"], needs=("tests", "deepspeed")),
        Check("conformance_megatron", "conformance layers 1-4 for Megatron-core", 20,
              ["-m", "peerflow", "conformance", "megatron"], needs=("tests", "megatron")),
        Check("quickstart_bf16", "hf + fsdp (FSDP2) in bf16 on CUDA learn the quickstart; "
              "rollout-vs-trainer log-prob mismatch per step", 55,
              [*_train(q, 40, "model.dtype=bfloat16", "run.checkpoint_every=20")], run_dir=q),
        Check("resume", "--resume continues the bf16 run from its step-40 checkpoint", 30,
              [*_train(q, 45, resume=True)], run_dir=q),
        Check("deepspeed_zero3", "DeepSpeed ZeRO-3 trains the quickstart on one GPU (NCCL)",
              35, [*_train(str(out / "runs" / "ds"), 8, "trainer.backend=deepspeed",
                           "trainer.deepspeed.zero_stage=3")],
              needs=("deepspeed",), run_dir=str(out / "runs" / "ds")),
        Check("megatron", "Megatron-core (distributed optimizer) trains the quickstart on one "
              "GPU", 35, [*_train(str(out / "runs" / "mg"), 8, "trainer.backend=megatron",
                                  "trainer.megatron.use_distributed_optimizer=true")],
              needs=("megatron",), run_dir=str(out / "runs" / "mg")),
        Check("nccl_pair", "the NCCL collectives the runtime uses, two processes on one GPU "
              "(or NCCL's reason why not)", 20, [checks, "nccl-pair"]),
        Check("cuda_ipc_pair", "the cuda_ipc weight transport between two processes on one "
              "GPU, time split plan/pack/wire/load", 35, [checks, "ipc-pair"]),
        Check("realsize", "a Qwen2.5-1.5B-shaped model (random weights, bf16): GRPO step "
              "tokens/s with ~512-token prompts and ~1024-token answers, peak memory, "
              "weight-sync time, sleep/wake memory", 110, [checks, "realsize"]),
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
            if not (ROOT / "peerflow" / "cli" / f"{argv[2]}_cmd.py").is_file():
                problems.append(f"{check.name}: `peerflow {argv[2]}` does not exist")
            problems += [f"{check.name}: {a} does not exist" for a in argv
                         if a.endswith(".yaml") and not (ROOT / a).is_file()]
        elif argv[:2] != ["-m", "pytest"]:
            problems.append(f"{check.name}: unexpected command {argv}")
    return problems


@dataclass
class Runner:
    """Runs the install and the checks, logging every command."""

    out: Path
    wheels: Path
    log: Any = None
    start: float = field(default_factory=time.monotonic)

    def say(self, text: str) -> None:
        """Prints a line and writes it to the log."""
        print(text, flush=True)
        self.log.write(text.rstrip() + "\n")
        self.log.flush()

    def run(self, argv: list[str], budget: float, env: dict[str, str] | None = None
            ) -> tuple[int | None, str, float]:
        """Runs a command; returns (exit status or None on timeout, output, seconds)."""
        self.say(f"$ {' '.join(argv)}   # budget {budget:.0f} s")
        began = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                  timeout=budget, env=env, start_new_session=True)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code = None
            output = (_text(exc.stdout) + _text(exc.stderr) + f"\n[timed out after "
                      f"{budget:.0f} s]")
        self.log.write(output + "\n")
        self.log.flush()
        return code, output, time.monotonic() - began

    def left(self) -> float:
        """Seconds left of the kit's total budget."""
        return TOTAL_BUDGET_S - (time.monotonic() - self.start)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def install(runner: Runner, folder: dict[str, Any]) -> dict[str, Any]:
    """Installs the wheel folder's files and PeerFlow (no index, the image's torch kept)."""
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
           "--no-build-isolation", "--disable-pip-version-check", "-q"]
    files = [str(runner.wheels / f) for f in folder["files"]]
    env = dict(os.environ, DS_BUILD_OPS="0")
    steps = []
    if files:
        steps.append(runner.run([*pip, *files], INSTALL_BUDGET_S * 0.6, env))
    steps.append(runner.run([*pip, "-e", str(ROOT)], INSTALL_BUDGET_S * 0.3, env))
    ok = all(code == 0 for code, _, _ in steps)
    return {**folder, "status": "passed" if ok else "failed",
            "seconds": round(sum(s for _, _, s in steps), 1),
            "errors": [out[-2000:] for code, out, _ in steps if code != 0]}


def run_check(runner: Runner, check: Check, missing: dict[str, list[str]]) -> dict[str, Any]:
    """Runs one check within its budget and returns its report entry."""
    entry = {"name": check.name, "proves": check.proves, "budget_s": check.budget_s,
             "command": ["python", *check.argv], "status": "skipped", "seconds": 0.0,
             "returncode": None, "figures": {}, "log_tail": ""}
    lacking = [g for g in check.needs if missing.get(g)]
    if lacking:
        entry["figures"] = {"reason": f"wheels missing for {', '.join(lacking)}: "
                            + ", ".join(n for g in lacking for n in missing[g])}
        return entry
    if runner.left() < check.budget_s:
        entry["figures"] = {"reason": f"out of time ({runner.left():.0f} s left)"}
        return entry
    code, output, seconds = runner.run([sys.executable, *check.argv], check.budget_s,
                                       dict(os.environ, HF_HUB_OFFLINE="1"))
    figures: dict[str, Any] = {}
    for line in output.splitlines():
        if line.startswith(FIGURES_PREFIX):
            figures.update(json.loads(line[len(FIGURES_PREFIX):]))
    if check.run_dir:
        figures.update(metrics_figures(Path(check.run_dir)))
    status = {None: "timeout", 0: "passed", UNSUPPORTED_EXIT: "unsupported"}.get(code, "failed")
    entry.update(status=status, seconds=round(seconds, 1), returncode=code, figures=figures,
                 log_tail=output[-1500:])
    return entry


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
        if args.dry_run:
            install_entry = {**folder, "status": "planned", "seconds": 0.0, "errors": []}
            entries = [{"name": c.name, "proves": c.proves, "budget_s": c.budget_s,
                        "command": ["python", *c.argv], "status": "planned", "seconds": 0.0,
                        "returncode": None, "figures": {}, "log_tail": ""} for c in checks]
            for e in entries:
                runner.say(f"[plan] {e['name']:<22} {e['budget_s']:>3} s  "
                           f"{' '.join(e['command'])}")
            device = None
        else:
            install_entry = install(runner, folder)
            entries = [run_check(runner, c, folder["missing"]) for c in checks]
            for e in entries:
                runner.say(f"[{e['status']}] {e['name']} ({e['seconds']} s) {e['figures']}")
            device = next((e["figures"] for e in entries if e["name"] == "env"), None)
        report = build_report(args.dry_run, install_entry, entries, device)
        problems = validate_report(report) + check_commands(checks)
        if args.dry_run and not folder["fits_transfer_limit"]:
            problems.append("the wheel folder and the tree exceed the transfer limit")
        for problem in problems:
            runner.say(f"report problem: {problem}")
    (out / "gpu-validate.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out / 'gpu-validate.json'}; log: {out / 'gpu-validate.log'}")
    failed = [e["name"] for e in entries if e["status"] in ("failed", "timeout")]
    return 1 if problems or failed else 0


if __name__ == "__main__":
    sys.exit(main())
