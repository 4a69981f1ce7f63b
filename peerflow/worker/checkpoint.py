"""Checkpoint and resume orchestration (the engines save their own state).

Layout of one checkpoint, written by every rank together:

    RUN_DIR/checkpoints/step_000040/
        <role>/                 each train engine's `save_checkpoint` (model + optimiser)
        worker_rank0.json …     per-rank sampler cursor, step, RNG state (JSON)
        COMPLETE                written last, by rank 0, after a barrier

A checkpoint without `COMPLETE` was interrupted and is ignored when resuming. Every file
is written to a temporary name and renamed, so a crash never leaves a half-written file
under its final name.
"""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from peerflow.errors import ConfigError

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Returns the directory of the checkpoint taken after `step`."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def write_json_atomic(path: Path, data: Any) -> None:
    """Writes JSON to `path` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """Returns the process's Python and torch CPU RNG states as JSON-ready data."""
    torch_state = torch.get_rng_state().numpy().tobytes()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch_state).decode(),
        "python": [py_version, list(py_state), py_gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores `rng_state()` output."""
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """Returns `(step, directory)` of the newest complete checkpoint, or `None`."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        if child.name.startswith("step_") and (child / COMPLETE).is_file():
            try:
                found.append((int(child.name[5:]), child))
            except ValueError:
                continue
    return max(found) if found else None


def find_resume_checkpoint(run_dir: str | Path) -> tuple[int, Path]:
    """Returns the checkpoint `peerflow train --resume RUN_DIR` continues from.

    Raises:
        ConfigError: the directory holds no complete checkpoint.
    """
    found = latest_checkpoint(run_dir)
    if found is None:
        raise ConfigError(
            f"--resume {str(run_dir)!r}: no complete checkpoint under "
            f"{Path(run_dir) / CHECKPOINTS}; a run saves one every run.checkpoint_every "
            "steps and at its end. Start a fresh run instead, or pick another run directory."
        )
    return found


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drops `metrics.jsonl` lines past `last_step` (steps re-run after a resume)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= last_step:
                kept.append(line)
        except (ValueError, AttributeError):
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
