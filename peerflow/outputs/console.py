"""What a run prints: one line per logged step, one per evaluation, a summary at the end.

The reporting rank prints them to stderr (`StepProgress`, above its bar on a terminal):

    step  3/100  reward 0.42±0.31  loss -0.0123  grad 0.83  kl 0.0021  entropy 1.23  len 3.9
    eval  2/100  greedy 0.25  sampled 0.19  pass@1 0.19  pass@2 0.31  len 3.5

(the step line goes on with `1.64k tok/s  0.85s`).

A field is shown when its metric was logged that step (`kl` only with a KL term,
`staleness` in async mode, the reward's components when there are several). The
summary (`run_summary`) gives the reward at the start and the end of the run, its best
step, the evaluations, where the checkpoint, samples and trackers are, and the commands
to run next.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: (label, metric, format) of the step line, in order; `reward` is formatted on its own.
STEP_FIELDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("loss", ("actor/loss", "actor/pg_loss"), ".3g"),
    ("vf_loss", ("critic/vf_loss",), ".3g"),
    ("grad", ("actor/grad_norm",), ".3g"),
    ("kl", ("kl/mean",), ".3g"),
    ("entropy", ("actor/entropy",), ".3g"),
    ("len", ("response_length/mean",), ".3g"),
    ("staleness", ("staleness/mean",), ".2g"),
)
#: `reward/<name>` keys that are not a reward's own score.
NOT_COMPONENTS = frozenset({"mean", "std", "min", "max", "frac_zero_std", "errors",
                            "timeouts"})


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _si(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _components(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Each reward's own mean score (`reward/<name>/mean`), by name."""
    found = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if (len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean"
                and parts[1] not in NOT_COMPONENTS and _number(value) is not None):
            found[parts[1]] = float(value)
    return dict(sorted(found.items()))


def step_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """The line of one training step: the numbers RL users watch, those logged only."""
    width = len(str(total))
    parts = [f"step {step:>{width}}/{total}"]
    reward, spread = _number(metrics.get("reward/mean")), _number(metrics.get("reward/std"))
    if reward is not None:
        text = f"reward {reward:.3g}" + (f"±{spread:.2g}" if spread is not None else "")
        components = _components(metrics)
        if len(components) > 1:
            text += " (" + ", ".join(f"{k} {v:.3g}" for k, v in components.items()) + ")"
        parts.append(text)
    for label, names, spec in STEP_FIELDS:
        value = next((v for v in map(_number, map(metrics.get, names)) if v is not None),
                     None)
        if value is not None:
            parts.append(f"{label} {value:{spec}}")
    tokens = _number(metrics.get("throughput/tokens_per_s"))
    if tokens is not None:
        parts.append(f"{_si(tokens)} tok/s")
    seconds = _number(metrics.get("time/step"))
    if seconds is not None:
        parts.append(f"{seconds:.3g}s")
    return "  ".join(parts)


def eval_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """The line of one evaluation (`eval/*` metrics of `step`; 0: before training)."""
    parts = [f"eval {step:>{len(str(total))}}/{total}"]
    for label, name in (("greedy", "eval/greedy/reward"), ("sampled", "eval/sampled/reward")):
        value = _number(metrics.get(name))
        if value is not None:
            parts.append(f"{label} {value:.3g}")
    for k in sorted(int(n.split("@")[1]) for n in metrics if n.startswith("eval/pass@")):
        value = _number(metrics.get(f"eval/pass@{k}"))
        if value is not None:
            parts.append(f"pass@{k} {value:.3g}")
    length = _number(metrics.get("eval/greedy/response_length",
                                 metrics.get("eval/sampled/response_length")))
    if length is not None:
        parts.append(f"len {length:.3g}")
    return "  ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def _reward_trend(records: Sequence[Mapping[str, Any]]) -> str | None:
    """`first → last` of `reward/mean` (windows of up to 5 logged steps), and the best."""
    series = [(int(r["step"]), v) for r in records
              if (v := _number(r.get("reward/mean"))) is not None]
    if not series:
        return None
    window = max(1, min(5, len(series) // 2))
    first = sum(v for _, v in series[:window]) / window
    last = sum(v for _, v in series[-window:]) / window
    best_step, best = max(series, key=lambda item: item[1])
    what = ("first → last logged step" if window == 1
            else f"means of the first and last {window} logged steps")
    return f"{first:.3g} → {last:.3g} ({what}; best {best:.3g} at step {best_step})"


def _eval_trend(records: Sequence[Mapping[str, Any]]) -> str | None:
    """The first and the last evaluation's rewards and pass@k."""
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    if not evals:
        return None
    first, last = evals[0], evals[-1]
    parts = []
    for label, name in (("greedy", "eval/greedy/reward"), ("sampled", "eval/sampled/reward")):
        a, b = _number(first.get(name)), _number(last.get(name))
        if b is not None:
            parts.append(f"{label} reward {a:.3g} → {b:.3g}" if len(evals) > 1 and a is not None
                         else f"{label} reward {b:.3g}")
    passes = sorted(int(n.split("@")[1]) for n in last if n.startswith("eval/pass@"))
    if passes and _number(last.get(f"eval/pass@{passes[-1]}")) is not None:
        parts.append(f"pass@{passes[-1]} {last[f'eval/pass@{passes[-1]}']:.3g}")
    steps = (f"step {first['step']} → {last['step']}" if len(evals) > 1
             else f"step {last['step']}")
    return ", ".join(parts) + f" ({steps})"


def run_summary(run_dir: str | Path, records: Sequence[Mapping[str, Any]], *, step: int,
                total: int, seconds: float, mode: str, checkpoint: str | None = None,
                trackers: Sequence[str] = (), start: int = 0) -> str:
    """The end-of-run summary: rewards, evaluation, where things are, what to run next.

    Args:
        run_dir: The run directory.
        records: The run's `metrics.jsonl` records (`read_metrics`).
        step: The last step done.
        total: `run.steps`.
        seconds: Wall time of this run (since start or resume).
        mode: `sync` or `async`.
        checkpoint: The newest complete checkpoint's directory (`None`: none).
        trackers: Where each tracker shows the run (`Tracker.location`).
        start: The step a resumed run started from (0: a fresh run).
    """
    run_dir = Path(run_dir)
    steps = f"{total} step{'s' if total != 1 else ''}"
    state = f"finished {steps}" if step >= total else f"stopped after step {step} of {steps}"
    since = f", resumed at step {start}" if start else ""
    lines = [f"peerflow: run {state} in {_duration(seconds)} ({mode} mode{since}): {run_dir}"]
    rows = [("reward", _reward_trend(records)), ("eval", _eval_trend(records)),
            ("checkpoint", checkpoint or "none written (run.checkpoint_every)"),
            ("metrics", str(run_dir / "metrics.jsonl"))]
    samples = run_dir / "samples"
    if samples.is_dir():
        rows.append(("samples", str(samples)))
    rows += [("tracker", location) for location in trackers]
    lines += [f"  {label:<10} {text}" for label, text in rows if text]
    lines.append("next:")
    commands = []
    if samples.is_dir():
        commands.append((f"peerflow samples {run_dir} --worst",
                         "the answers with the lowest reward"))
    commands.append((f"peerflow report {run_dir}", "plots and summary.json under report/"))
    if checkpoint:
        commands.append((f"peerflow export {run_dir} OUT_DIR",
                         "the checkpoint as a Hugging Face model directory"))
    if step < total:
        commands.append((f"peerflow train --resume {run_dir}", "continue the run"))
    width = max(len(c) for c, _ in commands)
    lines += [f"  {command:<{width}}  # {why}" for command, why in commands]
    return "\n".join(lines)
