"""The GPU validation kit's plan: every check, its budget, lane and phase (see gpu_validate.py).

Standard library only, like the rest of the kit. `plan_checks` lists the checks;
`check_commands` and `order_problems` are what the dry run checks the plan against.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_validate_checks import CHECKS  # noqa: E402
from gpu_validate_wheels import ROOT  # noqa: E402


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

    Phase 0 runs six lanes side by side (about 96-114 s for lanes A-C on the H200);
    phase 1 is `realsize` alone (the GPU to itself); phase 2 the benchmarks (`bench
    train` on the GPU, the coordinator's with a core per process).
    """
    runs = out / "runs"
    checks = "scripts/gpu_validate_checks.py"
    return [*_lane_checks(runs, checks), *_checks_alone(out, checks)]


def _lane_checks(runs: Path, checks: str) -> list[Check]:
    """Phase 0: the six lanes (A-F) that run side by side."""
    q = str(runs / "quickstart-bf16")
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
        Check("cuda_ipc_pair", "colocated weight sync over cuda_ipc, two processes on one "
              "GPU: GB/s cold and warm against the 500 GB/s goal, time split "
              "gather/pack/wire/load, bit for bit", 20, [checks, "ipc-pair"], "B",
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
        Check("moe_r3", "routing replay on the GPU: a tiny Qwen3-MoE sampled by the hf "
              "engine in bf16 (routes recorded), scored by the fsdp trainer with r3: "
              "agreement 1.0, log-prob mismatch smaller than native routing", 60,
              [checks, "moe-r3"], "E"),
        # lane F: vLLM's routes (a fifth of the GPU's memory beside the other lanes)
        Check("vllm_moe_r3", "routing replay from vLLM: a tiny Qwen3-MoE sampled by vLLM "
              "in bf16 with enable_return_routed_experts (Model Runner V2), a route for "
              "every token fed, replayed by the fsdp trainer with r3: agreement 1.0 "
              "(unsupported without vLLM on the image)", 150,
              [checks, "vllm-moe-r3"], "F"),
    ]


def _checks_alone(out: Path, checks: str) -> list[Check]:
    """Phases 1 and 2: `realsize` with the GPU to itself, then the benchmarks."""
    return [
        # phase 1: alone on the GPU
        Check("realsize", "a Qwen2.5-1.5B-shaped model (random weights, bf16): generate / "
              "train / weight-sync seconds, train MFU, peak GPU memory, ~512-token prompts "
              "and ~1024-token answers", 240, [checks, "realsize"], "R", phase=1),
        # phase 2: the CPUs (8 processes want 8 idle cores) and the GPU's one process
        Check("bench_train", "`peerflow bench train` on realsize's Qwen2.5-1.5B-shaped "
              "model (fsdp, bf16): padded vs padding-free tokens/s, padding fraction, peak "
              "memory, MFU (median of 3 steps each)", 60,
              [checks, "bench-train"], "T", phase=2),
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
