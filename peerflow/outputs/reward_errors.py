"""`RUN_DIR/reward_errors.jsonl` and `reward_errors.json`: what rewards failed on, and the tally.

* `reward_errors.jsonl` — one JSON object a line per (reward, sample) failure, appended by
  the ranks that score: `step`, `rank`, `reward`, `sample_id`, `prompt_index` (the
  dataset row), `status` (`error` or `timeout`), `message`, `traceback` (empty for a
  non-number, NaN or a time-out). Each append is one `write` to a file opened with
  `O_APPEND`, so lines of several ranks never interleave.
* `reward_errors.json` — the end-of-run tally the reporting rank writes: samples trained,
  samples a reward failed on, their share, per reward, and the configured
  `task.reward_limits.max_failure_share`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from peerflow.checkpoint.atomic import append_line, write_json_atomic
from peerflow.outputs.metrics import read_json_lines

ERRORS_FILE = "reward_errors.jsonl"
TALLY_FILE = "reward_errors.json"


def append_reward_errors(run_dir: str | Path, step: int, rank: int,
                         errors: Iterable[Any]) -> int:
    """Appends `RewardError`s (`peerflow.rewards.scoring`) of one scoring call.

    Returns:
        The number of lines written.
    """
    lines = [json.dumps({"step": int(step), "rank": int(rank), "reward": e.reward,
                         "sample_id": int(e.sample_id), "prompt_index": e.prompt_index,
                         "status": e.status, "message": e.message,
                         "traceback": e.traceback}, ensure_ascii=False, default=str) + "\n"
             for e in errors]
    if not lines:
        return 0
    append_line(Path(run_dir) / ERRORS_FILE, "".join(lines))  # whole or not at all
    return len(lines)


def read_reward_errors(run_dir: str | Path) -> list[dict[str, Any]]:
    """The failures recorded in `run_dir` (empty when none were)."""
    path = Path(run_dir) / ERRORS_FILE
    if not path.is_file():
        return []
    return read_json_lines(path, "reward error", required=("reward", "sample_id"))


def last_reward_error(run_dir: str | Path, reward: str) -> dict[str, Any] | None:
    """The newest failure of `reward` recorded in `run_dir` (or `None`)."""
    found = [e for e in read_reward_errors(run_dir) if e["reward"] == reward]
    return found[-1] if found else None


def write_tally(run_dir: str | Path, tally: dict[str, Any]) -> Path:
    """Writes the end-of-run tally (`reward_errors.json`) atomically."""
    return write_json_atomic(Path(run_dir) / TALLY_FILE, tally)
