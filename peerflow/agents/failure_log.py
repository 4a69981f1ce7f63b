"""`RUN_DIR/agent_errors.jsonl`: every agent episode that failed, with its traceback.

One JSON object a line per failed sample (`finish_reason` `env_error` or `env_timeout`),
appended by the ranks that score the step's episodes (the reward node, as
`reward_errors.jsonl` is): `step`, `rank`, `sample_id`, `group_id`, `prompt_index` (the
dataset row), `finish_reason`, `type` (the exception's class, or the driver's name for a
failure it found: `DivergentFirstPrompts`, `PromptPastContext`, `TimeoutError`),
`message` (the sample's `agent_error`) and `traceback` (empty when nothing was raised).
Each append is one `write` to a file opened with `O_APPEND`, so lines of several ranks
never interleave.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peerflow.agents.packing import AGENT_FAILURE
from peerflow.batch import Batch
from peerflow.checkpoint.atomic import append_line

AGENT_ERRORS_FILE = "agent_errors.jsonl"
#: The `finish_reason`s of an episode the environment (not the model) ended.
FAILED = ("env_error", "env_timeout")


def failure_lines(batch: Batch, step: int, rank: int) -> list[dict[str, Any]]:
    """The `agent_errors.jsonl` records of a batch's failed episodes (none without agents)."""
    if "finish_reason" not in batch or "agent_error" not in batch:
        return []
    failures = batch[AGENT_FAILURE] if AGENT_FAILURE in batch else [{}] * len(batch)
    examples = batch["example"] if "example" in batch else [None] * len(batch)
    records = []
    for i, reason in enumerate(batch["finish_reason"]):
        if reason not in FAILED:
            continue
        failure = failures[i] or {}
        records.append({"step": int(step), "rank": int(rank),
                        "sample_id": int(batch.sample_id[i]),
                        "group_id": int(batch.group_id[i]),
                        "prompt_index": getattr(examples[i], "index", None),
                        "finish_reason": reason, "type": failure.get("type", reason),
                        "message": batch["agent_error"][i],
                        "traceback": failure.get("traceback", "")})
    return records


def append_agent_errors(run_dir: str | Path, step: int, rank: int, batch: Batch) -> int:
    """Appends the failed episodes of `batch` to `RUN_DIR/agent_errors.jsonl`.

    Returns:
        The number of lines written.
    """
    lines = [json.dumps(r, ensure_ascii=False, default=str) + "\n"
             for r in failure_lines(batch, step, rank)]
    if not lines:
        return 0
    append_line(Path(run_dir) / AGENT_ERRORS_FILE, "".join(lines))  # whole or not at all
    return len(lines)


def read_agent_errors(run_dir: str | Path) -> list[dict[str, Any]]:
    """The failures recorded in `run_dir` (empty when none were)."""
    from peerflow.outputs.metrics import read_json_lines

    path = Path(run_dir) / AGENT_ERRORS_FILE
    if not path.is_file():
        return []
    return read_json_lines(path, "agent error", required=("step", "message"))
