"""The run's fingerprint: what must not change when a run is resumed.

`RUN_DIR/fingerprint.json` (written with `config.yaml`) records, flattened to dotted
keys, every setting a checkpoint depends on: the model (builder and its options, or the
directory's architecture from `config.json` and a SHA-256 of its tokenizer files) and its
dtype, the task, the algorithm, the workflow, the parallel layout rules and the seed.
`check_resume` compares it with the config a resume would run, before anything is loaded
or written, and refuses every difference, naming the key and both values.

It also records the size and SHA-256 of the dataset and of every file a reward is loaded
from (`peerflow.checkpoint.inputs`). A changed dataset is refused like any other
fingerprinted key (`--allow-change task` continues on the new data); a changed reward
file is not refused: the resume reports it in one line and appends it to
`RUN_DIR/changes.jsonl`.

Everything else — `run.steps`, `trainer.lr`, sampling temperature, timeouts, logging,
checkpoint cadence — may change on a resume with a plain `--set`. A fingerprinted key
may change only when the resume names it in `--allow-change KEY` (a key or a section
such as `algorithm.kl`); the model architecture, dtype and tokenizer never may, since
the saved weights could not load into another shape.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from peerflow.checkpoint.atomic import append_line, write_json_atomic
from peerflow.checkpoint.inputs import DATA_PREFIX, REWARD_PREFIX, input_facts
from peerflow.digests import sha256_files
from peerflow.errors import ConfigError
from peerflow.rollout.prompts import TOKENIZER_FILES

FINGERPRINT = "fingerprint.json"
#: Where a resume records what changed without being refused (reward files).
CHANGES = "changes.jsonl"
#: Keys of input files, which runs recorded since 2026-11-27 only.
INPUTS = (DATA_PREFIX, REWARD_PREFIX)
#: Dotted keys (or sections) a checkpoint depends on.
FINGERPRINTED = (
    "seed", "model", "task", "algorithm", "workflow", "rollout.layout", "trainer.layout",
    "trainer.backend", "trainer.lora", "rollout.sampling.n", "runtime.nprocs", "runtime.mode",
    "runtime.placement", "run.prompts_per_step",
)
#: Sections no `--allow-change` can release: the weights would not load.
NEVER_CHANGE = ("model", "tokenizer")
#: `config.json` entries that decide the shape of every weight.
ARCHITECTURE = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "tie_word_embeddings", "num_experts", "num_local_experts", "torch_dtype",
)


def _under(key: str, sections: Sequence[str]) -> bool:
    return any(key == s or key.startswith(s + ".") for s in sections)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _model_dir_facts(path: Path) -> dict[str, Any]:
    """Architecture entries of `config.json` and the tokenizer files' SHA-256."""
    facts: dict[str, Any] = {}
    config = path / "config.json"
    if config.is_file():
        saved = json.loads(config.read_text())
        facts.update({f"model.architecture.{k}": saved[k] for k in ARCHITECTURE if k in saved})
    tokenizer = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    if tokenizer:
        facts["tokenizer.sha256"] = sha256_files(tokenizer, root=path)[1]
    return facts


def fingerprint(config: Any) -> dict[str, Any]:
    """Returns the fingerprint of a `RunConfig`: dotted key → value, sorted by key."""
    from peerflow.config import unstructure

    plain = unstructure(config)
    flat = {k: v for k, v in _flatten(plain) if _under(k, FINGERPRINTED)
            and not (k == "trainer.lora" and v is None)}  # full fine-tuning: as before LoRA
    if config.model.path and Path(config.model.path).expanduser().is_dir():
        flat.update(_model_dir_facts(Path(config.model.path).expanduser()))
    flat.update(input_facts(plain))
    return dict(sorted(flat.items()))


def write_fingerprint(run_dir: str | Path, config: Any) -> Path:
    """Records `config`'s fingerprint in `RUN_DIR/fingerprint.json` (atomically)."""
    return write_json_atomic(Path(run_dir) / FINGERPRINT, fingerprint(config))


def recorded_fingerprint(run_dir: str | Path) -> dict[str, Any] | None:
    """The fingerprint the run recorded; for older runs, that of its `config.yaml`."""
    run_dir = Path(run_dir)
    if (run_dir / FINGERPRINT).is_file():
        return json.loads((run_dir / FINGERPRINT).read_text())
    if (run_dir / "config.yaml").is_file():
        from peerflow.config import load_config

        return fingerprint(load_config(run_dir / "config.yaml"))
    return None


def check_resume(run_dir: str | Path, config: Any, allow_change: Sequence[str] = (),
                 report: Callable[[str], None] | None = None) -> None:
    """Refuses a resume whose config differs from the run's in a fingerprinted key.

    Args:
        run_dir: The run directory being resumed.
        config: The `RunConfig` the resume would run.
        allow_change: Keys or sections (`--allow-change`) that may differ.
        report: Where the one line about changed reward files goes (default: stderr);
            they are also appended to `RUN_DIR/changes.jsonl`.

    Raises:
        ConfigError: a fingerprinted key differs and is not allowed to (each named with
            the recorded and the new value), or `allow_change` names a key that no
            override can release.
    """
    fixed = [key for key in allow_change if _under(key, NEVER_CHANGE)]
    if fixed:
        raise ConfigError(
            f"--allow-change {', '.join(fixed)}: the model architecture, dtype and tokenizer "
            "cannot change on a resume (the saved weights would not load); start a fresh run."
        )
    recorded = recorded_fingerprint(run_dir)
    if recorded is None:
        return
    now = fingerprint(config)
    missing = object()
    differ = [(key, recorded.get(key, missing), now.get(key, missing))
              for key in sorted(set(recorded) | set(now))
              if recorded.get(key, missing) != now.get(key, missing)
              and not (key not in recorded and key.startswith(INPUTS))]  # older runs
    rewards = [d for d in differ if d[0].startswith(REWARD_PREFIX)]
    differ = [d for d in differ if d not in rewards and not _under(d[0], allow_change)]
    if rewards and not differ:
        _record_reward_changes(Path(run_dir), rewards, report)
    if not differ:
        return

    def show(value: Any) -> str:
        return "(absent)" if value is missing else json.dumps(value)

    lines = "\n".join(f"  {key}: run has {show(old)}, resume has {show(new)}"
                      for key, old, new in differ)
    data = sorted({key[len(DATA_PREFIX):].rsplit(".", 1)[0] for key, *_ in differ
                   if key.startswith(DATA_PREFIX)})
    hint = (f"The dataset changed (task.options {', '.join(data)}): the run's sampler "
            "position and RNG state would index other rows. Resume with the original data, "
            "or add `--allow-change task` to continue on the changed data.\n" if data else "")
    raise ConfigError(
        f"--resume {str(run_dir)!r}: the config differs from the run's in settings a "
        f"checkpoint depends on ({Path(run_dir) / FINGERPRINT}):\n{lines}\n{hint}"
        "Resume with the run's own settings (drop those --set overrides), or start a fresh "
        "run. To change a setting other than the model's architecture, dtype or tokenizer "
        "on purpose, add `--allow-change KEY` for it (e.g. --allow-change algorithm.kl.coef)."
    )


def _record_reward_changes(run_dir: Path, changes: list[tuple[str, Any, Any]],
                           report: Callable[[str], None] | None) -> None:
    """Reports changed reward files in one line and appends them to `changes.jsonl`."""
    files = sorted({key[len(REWARD_PREFIX):].rsplit(".", 1)[0] for key, *_ in changes})
    line = (f"peerflow train: reward file{'s' if len(files) > 1 else ''} changed since the "
            f"run's last start: {', '.join(files)} (recorded in {run_dir / CHANGES})")
    record = {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "changed": {key: {"run": old, "resume": new} for key, old, new in changes}}
    append_line(run_dir / CHANGES, json.dumps(record, default=str))
    (report or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
