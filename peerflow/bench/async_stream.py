"""Async vs sync GRPO throughput on split placement, long-tailed response lengths.

Both sides run the same config, task, budget (steps × prompts × group size) and ranks:
one rollout rank and one trainer rank (`runtime.placement: split`). The sync side runs
the multi-controller step (generate, then train, then sync weights: each group waits for
the other); the async side streams with `runtime.max_staleness: K`. Response lengths are
long-tailed: the untrained model stops only when it samples EOS, so lengths are roughly
geometric up to `--max-tokens`. The async side generates step `s + 1` while the trainer
trains step `s`; with `--prompts-per-call` smaller than a step's prompts, short groups
also stream ahead of long ones (worth it on engines with continuous batching; the hf
reference engine pays a full forward per token per call, so one call per step is best).

Rates are prompt + response tokens trained per second of the training loop, skipping the
first step (start-up and the first weight transfer); idle fractions average the rollout
and trainer groups. Both sides train the same number of samples per step and make one
optimiser step per step, but their responses differ after the first step (the async
side samples with weights up to K versions older), so token counts differ a little:
`step_ratio` (sync / async seconds per step) compares equal work in samples and optimiser
steps, `ratio` equal tokens. Figures are medians over `--runs` repetitions, sides interleaved.

`--shape quickstart` (default): the config's model, 8 steps of 8 prompts × 8 answers up
to 48 tokens. `--shape realistic`: the realistic shape of `peerflow.bench.shapes` (the
~50 M bench model, 128-token prompts, geometric answer lengths up to 512 tokens), 3 steps
of 1 prompt × 4 answers (counts, not shape, cut to keep a run short).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peerflow.bench.e2e import worker_env
from peerflow.bench.options import (
    add_both_sides_config_argument,
    add_both_sides_override_argument,
    add_runs_argument,
)
from peerflow.bench.shapes import MAX_TOKENS, add_shape_argument, config_overrides, pick

#: Phases the trainer group computes in a synchronous step (it waits for the rest, and
#: both groups take part in the data route and the weight sync).
TRAINER_PHASES = ("old_logprob", "ref_logprob", "values", "advantage", "train_actor",
                  "train_critic")
ROLLOUT_PHASES = ("generate", "reward")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    add_both_sides_config_argument(parser)
    add_shape_argument(parser)
    parser.add_argument("--steps", type=int, help="training steps per side (quickstart 8, "
                        "realistic 3)")
    parser.add_argument("--max-staleness", type=int, default=1, help="K of the async side")
    parser.add_argument("--prompts-per-step", type=int, help="quickstart 8, realistic 1")
    parser.add_argument("--n", type=int, help="answers per prompt (quickstart 8, realistic 4)")
    parser.add_argument("--max-tokens", type=int, help="response cap, the length tail's end "
                        f"(quickstart 48, realistic {MAX_TOKENS})")
    parser.add_argument("--prompts-per-call", type=int, default=0,
                        help="async side: prompts per generate call (0: the whole step's, "
                        "best for engines without continuous batching such as hf)")
    add_runs_argument(parser, 1, "repetitions (medians reported)")
    add_both_sides_override_argument(parser)


def _train(config: str, overrides: list[str], work: Path, label: str) -> list[dict[str, Any]]:
    run_dir = work / f"{label}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "peerflow", "train", config, "--nprocs", "2",
           "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    log = work / f"{label}.log"
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=worker_env())
    if proc.returncode:
        raise RuntimeError(f"{label} run exited {proc.returncode}; log {log}:\n"
                           f"{log.read_text()[-3000:]}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def _rate(rows: list[dict[str, Any]]) -> float:
    timed = rows[1:] or rows
    seconds = sum(r.get("time/step", 0.0) for r in timed)
    return sum(r.get("tokens/total", 0.0) for r in timed) / seconds if seconds else 0.0


def _idle_sync(rows: list[dict[str, Any]]) -> float:
    fractions = []
    for r in rows[1:] or rows:
        step = r.get("time/step", 0.0)
        if step <= 0:
            continue
        rollout = sum(r.get(f"time/{p}", 0.0) for p in ROLLOUT_PHASES)
        trainer = sum(r.get(f"time/{p}", 0.0) for p in TRAINER_PHASES)
        fractions.append(((1 - min(rollout / step, 1)) + (1 - min(trainer / step, 1))) / 2)
    return statistics.fmean(fractions) if fractions else 0.0


def _idle_async(rows: list[dict[str, Any]]) -> float:
    fractions = [(r.get("idle/rollout_fraction", 0.0) + r.get("idle/trainer_fraction", 0.0)) / 2
                 for r in rows[1:] or rows]
    return statistics.fmean(fractions) if fractions else 0.0


def _tokens_per_step(rows: list[dict[str, Any]]) -> float:
    return statistics.fmean(r.get("tokens/total", 0.0) for r in rows[1:] or rows)


def _phase_seconds(rows: list[dict[str, Any]], phases: tuple[str, ...]) -> float:
    timed = rows[1:] or rows
    return statistics.fmean(sum(r.get(f"time/{p}", 0.0) for p in phases) for r in timed)


def _late_reward(rows: list[dict[str, Any]]) -> float:
    half = rows[len(rows) // 2:] or rows
    return statistics.fmean(r.get("reward/mean", 0.0) for r in half)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs both sides `--runs` times and returns the JSON result."""
    args.steps = pick(args.steps, args.shape, 8, 3)
    args.prompts_per_step = pick(args.prompts_per_step, args.shape, 8, 1)
    args.n = pick(args.n, args.shape, 8, 4)
    args.max_tokens = pick(args.max_tokens, args.shape, 48, MAX_TOKENS)
    common = [
        *config_overrides(args.shape),
        f"run.steps={args.steps}", f"run.prompts_per_step={args.prompts_per_step}",
        f"rollout.sampling.n={args.n}", f"rollout.sampling.max_tokens={args.max_tokens}",
        "runtime.placement=split", "rollout.layout.dp=1", "trainer.layout.dp=1",
        "run.checkpoint_every=0", "run.tensorboard=false", "run.trace=false",
        *args.overrides,
    ]
    sync_side = [*common, "runtime.mode=sync"]
    async_side = [*common, "runtime.mode=async", f"runtime.max_staleness={args.max_staleness}",
                  f"runtime.async_prompts_per_call={args.prompts_per_call}"]
    results: dict[str, list[float]] = {k: [] for k in (
        "sync_rate", "async_rate", "ratio", "idle_sync", "idle_async", "reward_sync",
        "reward_async", "generate_s", "train_s", "step_s", "async_step_s", "step_ratio",
        "sync_tokens_per_step", "async_tokens_per_step")}
    seen = 0.0
    with tempfile.TemporaryDirectory(prefix="peerflow-bench-async-") as tmp:
        work = Path(tmp)
        for _ in range(max(args.runs, 1)):
            sync_rows = _train(args.config, sync_side, work, "sync")
            async_rows = _train(args.config, async_side, work, "async")
            sync_rate, async_rate = _rate(sync_rows), _rate(async_rows)
            results["sync_rate"].append(sync_rate)
            results["async_rate"].append(async_rate)
            results["ratio"].append(async_rate / sync_rate if sync_rate else 0.0)
            results["idle_sync"].append(_idle_sync(sync_rows))
            results["idle_async"].append(_idle_async(async_rows))
            results["reward_sync"].append(_late_reward(sync_rows))
            results["reward_async"].append(_late_reward(async_rows))
            results["generate_s"].append(_phase_seconds(sync_rows, ROLLOUT_PHASES))
            results["train_s"].append(_phase_seconds(sync_rows, TRAINER_PHASES))
            results["step_s"].append(_phase_seconds(sync_rows, ("step",)))
            results["async_step_s"].append(_phase_seconds(async_rows, ("step",)))
            results["step_ratio"].append(results["step_s"][-1] / results["async_step_s"][-1])
            results["sync_tokens_per_step"].append(_tokens_per_step(sync_rows))
            results["async_tokens_per_step"].append(_tokens_per_step(async_rows))
            seen = max([seen, *(r.get("staleness/max", 0.0) for r in async_rows)])
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "sync_tokens_per_s": med["sync_rate"],
        "async_tokens_per_s": med["async_rate"],
        "ratio": med["ratio"],
        "step_ratio": med["step_ratio"],
        "sync_tokens_per_step": med["sync_tokens_per_step"],
        "async_tokens_per_step": med["async_tokens_per_step"],
        "max_staleness": args.max_staleness,
        "max_staleness_seen": int(seen),
        "idle_fraction_sync": med["idle_sync"],
        "idle_fraction_async": med["idle_async"],
        "reward_late_sync": med["reward_sync"],
        "reward_late_async": med["reward_async"],
        "sync_step_s": med["step_s"],
        "async_step_s": med["async_step_s"],
        "sync_rollout_s_per_step": med["generate_s"],
        "sync_trainer_s_per_step": med["train_s"],
        "ideal_ratio": med["step_s"] / max(med["generate_s"], med["train_s"], 1e-9),
        "shape": args.shape,
        "steps": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "runs": results,
        "median_of": len(results["ratio"]),
    }
