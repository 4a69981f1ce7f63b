"""The run's fingerprint: what must not change when a run is resumed.

`RUN_DIR/fingerprint.json` (written with `config.yaml`) records, flattened to dotted
keys, every setting a checkpoint depends on: the model (builder and its options, or the
directory's architecture from `config.json` and a SHA-256 of its tokenizer files) and its
dtype, the task, the algorithm, the workflow, the parallel layout rules and the seed.
`check_resume` compares it with the config a resume would run, before anything is loaded
or written, and refuses every difference, naming the key and both values.

Everything else — `run.steps`, `trainer.lr`, sampling temperature, timeouts, logging,
checkpoint cadence — may change on a resume with a plain `--set`. A fingerprinted key
may change only when the resume names it in `--allow-change KEY` (a key or a section
such as `algorithm.kl`); the model architecture, dtype and tokenizer never may, since
the saved weights could not load into another shape.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from peerflow.checkpoint.atomic import write_json_atomic
from peerflow.errors import ConfigError

FINGERPRINT = "fingerprint.json"
#: Dotted keys (or sections) a checkpoint depends on.
FINGERPRINTED = (
    "seed", "model", "task", "algorithm", "workflow", "rollout.layout", "trainer.layout",
    "trainer.backend", "rollout.sampling.n", "runtime.nprocs", "runtime.mode",
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
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json",
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
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        if (path / name).is_file():
            found = True
            digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    if found:
        facts["tokenizer.sha256"] = digest.hexdigest()
    return facts


def fingerprint(config: Any) -> dict[str, Any]:
    """Returns the fingerprint of a `RunConfig`: dotted key → value, sorted by key."""
    from peerflow.config import unstructure

    flat = {k: v for k, v in _flatten(unstructure(config)) if _under(k, FINGERPRINTED)}
    if config.model.path and Path(config.model.path).expanduser().is_dir():
        flat.update(_model_dir_facts(Path(config.model.path).expanduser()))
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


def check_resume(run_dir: str | Path, config: Any, allow_change: Sequence[str] = ()) -> None:
    """Refuses a resume whose config differs from the run's in a fingerprinted key.

    Args:
        run_dir: The run directory being resumed.
        config: The `RunConfig` the resume would run.
        allow_change: Keys or sections (`--allow-change`) that may differ.

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
              and not _under(key, allow_change)]
    if not differ:
        return

    def show(value: Any) -> str:
        return "(absent)" if value is missing else json.dumps(value)

    lines = "\n".join(f"  {key}: run has {show(old)}, resume has {show(new)}"
                      for key, old, new in differ)
    raise ConfigError(
        f"--resume {str(run_dir)!r}: the config differs from the run's in settings a "
        f"checkpoint depends on ({Path(run_dir) / FINGERPRINT}):\n{lines}\n"
        "Resume with the run's own settings (drop those --set overrides), or start a fresh "
        "run. To change a setting other than the model's architecture, dtype or tokenizer "
        "on purpose, add `--allow-change KEY` for it (e.g. --allow-change algorithm.kl.coef)."
    )
