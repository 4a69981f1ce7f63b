"""End-to-end GRPO throughput: PeerFlow vs TRL's GRPOTrainer on the same run.

Both sides run the same config (task, model directory, prompts per step, group size, max
tokens, steps, learning rate) with the same number of processes. Tokens are prompt plus
generated tokens processed; the rate divides them by the wall time of the whole command
(start-up, model load, every step) — what a user waits for. Train-loop-only rates are
reported alongside. Figures are medians over `--runs` repetitions, sides interleaved.

`--shape quickstart` (default) runs the config as written (the quickstart: 32 prompts ×
16 answers of up to 4 tokens, 20 steps). `--shape realistic` runs it on the realistic
shape of `peerflow.bench.shapes` on both sides — the ~50 M-parameter bench model,
128-token `reverse-digits` prompts, long-tailed answers up to 512 tokens — with 2 prompts
× 4 answers a step for 3 steps (counts, not shape, are cut to keep a run short). Each side
reports its mean answer length and the share that hit the cap.

Same work on both sides: the same sampling settings, one torch thread per process,
activation recomputation only where PeerFlow's trainer does it, and run `i` of `--runs`
seeded `seed + i` on both sides. Answer lengths are random, so each side also reports the
work it drew (`work`: answer tokens, and decode steps — each step's longest answer,
summed — which is what batched generation costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peerflow.bench.options import (
    add_both_sides_config_argument,
    add_both_sides_override_argument,
    add_runs_argument,
)
from peerflow.bench.shapes import add_shape_argument, config_overrides, pick


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    add_both_sides_config_argument(parser)
    add_shape_argument(parser)
    parser.add_argument("--nprocs", type=int, default=2, help="processes per side")
    parser.add_argument("--steps", type=int,
                        help="training steps per side (quickstart 20, realistic 3)")
    add_runs_argument(parser, 1, "repetitions (medians reported)")
    add_both_sides_override_argument(parser)
    parser.add_argument("--skip-trl", action="store_true",
                        help="measure PeerFlow only (TRL not installed)")


def worker_env() -> dict[str, str]:
    """Returns the environment for a benchmarked `peerflow train` child: one thread, offline."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=worker_env())
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} … exited {proc.returncode}; log {log}:\n{tail}")
    return wall


def run_peerflow(args: argparse.Namespace, overrides: list[str], work: Path) -> dict[str, Any]:
    """Runs `peerflow train` and returns tokens, wall and train-loop seconds.

    The loop is the summed `time/iteration` (each step with the driver's work between
    steps), the span `e2e_trl` times on TRL's side.

    `phases_s` sums the run's `time/<phase>` (max over ranks per step): where the time goes.
    `balance` averages the `balance/*` metrics over the steps: the trainer dp-ranks' busiest
    token load over their mean before and after samples are balanced (1 is even).
    """
    run_dir = work / f"peerflow-{time.time_ns()}"
    cmd = [sys.executable, "-m", "peerflow", "train", args.config, "--nprocs", str(args.nprocs),
           "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    wall = _run(cmd, work / "peerflow.log")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    tokens = sum(m.get("tokens/total", 0.0) for m in lines)
    train_s = sum(m.get("time/iteration", m.get("time/step", 0.0)) for m in lines)
    phases: dict[str, float] = {}
    for m in lines:
        for key, value in m.items():
            if (key.startswith("time/") and key not in ("time/step", "time/iteration")
                    and isinstance(value, float)):
                phases[key[5:]] = phases.get(key[5:], 0.0) + value
    return {"tokens": tokens, "wall_s": wall, "train_s": train_s,
            "startup_s": max(wall - train_s, 0.0), "phases_s": phases,
            "response_length_mean": _mean(m.get("response_length/mean", 0.0) for m in lines),
            **_work([m.get("response_length/max", 0.0) for m in lines],
                    [m.get("response_length/mean", 0.0) for m in lines],
                    args.prompts_per_step * args.n),
            "response_clip_frac": _mean(m.get("response_length/clip_frac", 0.0) for m in lines),
            "balance": {key[8:]: _mean(m[key] for m in lines if key in m)
                        for key in sorted({k for m in lines for k in m
                                           if k.startswith("balance/")})},
            "reward_first": lines[0].get("reward/mean", 0.0) if lines else 0.0,
            "reward_last": lines[-1].get("reward/mean", 0.0) if lines else 0.0}


def run_trl(args: argparse.Namespace, overrides: list[str], work: Path) -> dict[str, Any]:
    """Runs TRL's GRPOTrainer under torchrun and returns tokens, wall and train seconds."""
    out = work / f"trl-{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(args.nprocs), "-m", "peerflow.bench.e2e_trl",
           "--config", args.config, "--out", str(out), "--workdir", str(work)]
    for item in overrides:
        cmd += ["--set", item]
    wall = _run(cmd, work / "trl.log")
    result = json.loads(out.read_text())
    rewards = result.get("reward") or [0.0]
    return {"tokens": result["tokens"], "wall_s": wall, "train_s": result["train_s"],
            "startup_s": max(wall - result["train_s"], 0.0),
            "response_length_mean": _mean(result.get("mean_length") or [0.0]),
            **_work(result.get("max_length") or [], result.get("mean_length") or [],
                    args.prompts_per_step * args.n),
            "generate_s": sum(result.get("generate_s") or []),
            "response_clip_frac": _mean(result.get("clipped_ratio") or [0.0]),
            "reward_first": rewards[0], "reward_last": rewards[-1]}


def _work(longest: list[float], mean: list[float], answers: int) -> dict[str, float]:
    """The generation work a run drew: its answer tokens and its decode steps.

    A step's batched decode runs until its longest answer ends, so `decode_steps` (the
    longest answer of each step, summed) is what generation costs, while the token
    count grows with every answer. Sides that drew different lengths did different work.
    """
    return {"response_tokens": round(sum(m * answers for m in mean)),
            "decode_steps": sum(longest)}


def _mean(values: Any) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs both sides `--runs` times and returns the JSON result."""
    from peerflow.config import load_config

    args.steps = pick(args.steps, args.shape, 20, 3)
    shape = config_overrides(args.shape)
    if shape:
        shape += ["run.prompts_per_step=2", "rollout.sampling.n=4"]
    overrides = [*shape, f"run.steps={args.steps}", f"runtime.nprocs={args.nprocs}",
                 *args.overrides]
    config = load_config(args.config, overrides)
    args.prompts_per_step, args.n = config.run.prompts_per_step, config.rollout.sampling.n
    peerflow: list[dict[str, Any]] = []
    trl: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peerflow-bench-e2e-") as tmp:
        work = Path(tmp)
        for run_index in range(args.runs):
            # Each run draws other answers (seed + run index), the same seed on both sides:
            # over runs neither side keeps one lucky or unlucky draw of answer lengths.
            seeded = [*overrides, f"seed={config.seed + run_index}"]
            peerflow.append(run_peerflow(args, seeded, work))
            if not args.skip_trl:
                trl.append(run_trl(args, seeded, work))

    def rate(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r["tokens"] / r[key] for r in rows) if rows else 0.0

    pf, tr = rate(peerflow, "wall_s"), rate(trl, "wall_s")
    pf_loop, tr_loop = rate(peerflow, "train_s"), rate(trl, "train_s")
    return {
        "benchmark": "e2e",
        "peerflow_tokens_per_s": pf,
        "trl_tokens_per_s": tr,
        "ratio": pf / tr if tr else None,
        "train_loop": {"peerflow_tokens_per_s": pf_loop, "trl_tokens_per_s": tr_loop,
                       "ratio": pf_loop / tr_loop if tr_loop else None},
        "median_of": args.runs,
        "response_length_mean": {"peerflow": _mean(r["response_length_mean"] for r in peerflow),
                                 "trl": _mean(r["response_length_mean"] for r in trl)},
        "work": {side: {key: statistics.median(r[key] for r in rows) if rows else 0.0
                        for key in ("response_tokens", "decode_steps")}
                 for side, rows in (("peerflow", peerflow), ("trl", trl))},
        "settings": {"config": args.config, "shape": args.shape, "nprocs": args.nprocs,
                     "steps": args.steps, "overrides": overrides},
        "runs": {"peerflow": peerflow, "trl": trl},
    }
