"""`RUN_DIR/samples/`: what the model generated, a few samples a step, and every eval sample.

Files (one JSON object a line, written atomically by the run's reporting rank):

* `samples/step_N.jsonl` — the first `run.samples_per_step` samples of training step `N`
  (by `sample_id`; `N` as a plain integer, `step_1.jsonl`, `step_12.jsonl`);
* `samples/eval_step_N.jsonl` — every sample of the evaluation after step `N` (0: the
  initial model; `peerflow eval` writes the checkpoint's step).

Fields of a sample: `step`, `sample_id`, `group_id` (the prompt's group), `prompt` (the
decoded prompt the model saw, chat template included), `response` (decoded, special
tokens removed: what the rewards read), `reward` (the total reward the estimator used;
`null` when the batch has none), `components` (`{reward name: unweighted score}`),
`advantage` (training only: the mean of the sample's per-token advantages, `null`
without one), `finish_reason`, `response_tokens` (tokens the model generated), and
`num_turns` for agent trajectories; eval samples carry `mode` (`greedy` or `sampled`).

`peerflow samples RUN_DIR` reads them (`read_samples`, `render_samples`); what it prints
has every control character escaped (`peerflow.outputs.terminal`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from peerflow.checkpoint.atomic import write_text_atomic
from peerflow.outputs.metrics import read_json_lines
from peerflow.outputs.terminal import escape_control

SAMPLES_DIR = "samples"
_NAME = re.compile(r"^(eval_)?step_(\d+)\.jsonl$")


def samples_path(run_dir: str | Path, step: int, *, evaluation: bool = False) -> Path:
    """The file holding `step`'s samples (training, or with `evaluation` the evaluation's)."""
    prefix = "eval_step" if evaluation else "step"
    return Path(run_dir) / SAMPLES_DIR / f"{prefix}_{int(step)}.jsonl"


def write_samples(run_dir: str | Path, step: int, records: Iterable[dict[str, Any]], *,
                  evaluation: bool = False) -> Path:
    """Writes one step's samples atomically (replacing a file a crashed run left).

    Args:
        run_dir: The run directory.
        step: The step the samples belong to.
        records: JSON-ready sample dicts, in the order to keep.
        evaluation: Evaluation samples (`eval_step_N.jsonl`) instead of training ones.

    Returns:
        The path written.
    """
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return write_text_atomic(samples_path(run_dir, step, evaluation=evaluation), text)


def sample_steps(run_dir: str | Path, *, evaluation: bool = False) -> list[int]:
    """The steps that have samples in `run_dir`, ascending (empty: none)."""
    directory = Path(run_dir) / SAMPLES_DIR
    if not directory.is_dir():
        return []
    steps = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match and bool(match.group(1)) == evaluation:
            steps.append(int(match.group(2)))
    return sorted(steps)


def describe_steps(steps: Sequence[int]) -> str:
    """Steps as compact ranges: `[1, 2, 3, 5]` → `1-3, 5`."""
    parts: list[str] = []
    ordered = sorted(set(steps))
    start = prev = None
    for step in [*ordered, None]:
        if start is not None and (step is None or step != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if step is not None and start is None:
            start = step
        prev = step
    return ", ".join(parts)


def read_samples(run_dir: str | Path, step: int | None = None, *, evaluation: bool = False
                 ) -> tuple[int, list[dict[str, Any]]]:
    """Reads the samples of `step` (default: the newest step that has some).

    Returns:
        `(step, samples)`.

    Raises:
        FileNotFoundError: `run_dir` is not a directory, has no samples, or none for
            `step`; the message names the steps that have samples and the setting.
        ValueError: a line is not a JSON object (naming the file and line).
    """
    run_dir = Path(run_dir)
    kind = "eval samples" if evaluation else "samples"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist.")
    steps = sample_steps(run_dir, evaluation=evaluation)
    if not steps:
        how = ("run.eval_every > 0, or run `peerflow eval`" if evaluation
               else "run.samples_per_step > 0 (default 8)")
        pattern = samples_path(run_dir, 0, evaluation=evaluation).name.replace("0", "N")
        raise FileNotFoundError(f"no {kind} in {run_dir} (looked for "
                                f"{run_dir / SAMPLES_DIR / pattern}); set {how}.")
    if step is None:
        step = steps[-1]
    if step not in steps:
        every = "" if evaluation else " (every step has some while run.samples_per_step > 0)"
        raise FileNotFoundError(f"no {kind} for step {step} in {run_dir}; steps with "
                                f"{kind}: {describe_steps(steps)}{every}.")
    path = samples_path(run_dir, step, evaluation=evaluation)
    return step, read_json_lines(path, "sample")


def order_samples(samples: Sequence[dict[str, Any]], *, worst: bool = False,
                  best: bool = False, limit: int | None = None) -> list[dict[str, Any]]:
    """Orders samples for showing, then keeps the first `limit`.

    By reward with `worst` (lowest first) or `best` (highest first), samples without a
    reward last; else as written (by `sample_id`).
    """
    ordered = list(samples)
    if worst or best:
        scored = [s for s in ordered if isinstance(s.get("reward"), int | float)]
        unscored = [s for s in ordered if not isinstance(s.get("reward"), int | float)]
        scored.sort(key=lambda s: s["reward"], reverse=best)
        ordered = scored + unscored
    return ordered[:limit] if limit is not None and limit >= 0 else ordered


def _number(value: Any, signed: bool = False) -> str:
    if isinstance(value, int | float):
        return f"{value:+.3f}" if signed else f"{value:.3f}"
    return "—"


def sample_title(sample: dict[str, Any]) -> str:
    """A panel's title: the sample, its group, the eval mode, its reward."""
    parts = [f"sample {sample.get('sample_id', '?')}", f"group {sample.get('group_id', '?')}"]
    if "mode" in sample:
        parts.append(str(sample["mode"]))
    parts.append(f"reward {_number(sample.get('reward'))}")
    return " · ".join(parts)


def sample_details(sample: dict[str, Any]) -> str:
    """A panel's first line: reward components, advantage, length, finish reason, turns."""
    parts = [f"{name} {_number(value)}"
             for name, value in sorted((sample.get("components") or {}).items())]
    if "advantage" in sample:
        parts.append(f"advantage {_number(sample.get('advantage'), signed=True)}")
    parts.append(f"{sample.get('response_tokens', '?')} tokens, "
                 f"{sample.get('finish_reason') or '?'}")
    if sample.get("num_turns") is not None:
        parts.append(f"{sample['num_turns']} turns")
    return " · ".join(parts)


def render_samples(samples: Sequence[dict[str, Any]], *, step: int, console: Any = None,
                   header: str = "") -> None:
    r"""Prints samples as rich panels: the numbers first, then prompt and response.

    Every text from the file goes through `escape_control`: an escape sequence in a
    response is shown (`\x1b[2J`), not obeyed.

    Args:
        samples: Sample dicts as `read_samples` returns them (already ordered).
        step: The step shown (for the heading).
        console: A `rich.console.Console` (default: a new one on stdout).
        header: Text after the heading (e.g. the ordering).
    """
    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.text import Text

    console = console or Console()
    noun = "sample" if len(samples) == 1 else "samples"
    console.print(Text(f"step {step}: {len(samples)} {noun}{header}", style="bold"))
    for sample in samples:
        body = Group(Text(escape_control(sample_details(sample)), style="italic"),
                     Text("prompt", style="bold cyan"),
                     Text(escape_control(sample.get("prompt", "")), style="dim"),
                     Text("response", style="bold green"),
                     Text(escape_control(sample.get("response", ""))))
        console.print(Panel(body, title=Text(escape_control(sample_title(sample))),
                            title_align="left"))
