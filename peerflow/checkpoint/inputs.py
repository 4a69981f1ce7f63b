"""The files a run reads besides the model: its dataset and the code of its rewards.

A resume that reads a different dataset continues with a sampler position and RNG state
that index other rows; a reward file edited between a run and its resume changes what
the run optimises. `input_facts(config)` records the size and SHA-256 of each, for the
run's fingerprint (`peerflow.checkpoint.fingerprint`):

* `task.data.<option>.size` / `.sha256` — every file or directory a `task.options` entry
  whose name mentions a path, file or data names (`path`, `eval_path`, `data_files`, …);
  a directory (`save_to_disk`, a parquet folder) hashes its files' names and contents;
* `reward_file.<file>.size` / `.sha256` — the file every reward of `task.reward`,
  `task.rewards` and `rollout.agent` is loaded from (`path/to/file.py:fn`, or the module's
  source of `package.module:fn`). Registered names (plugins) are code of an installed
  package and are not hashed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from peerflow.digests import sha256_files

#: Key prefix of the dataset's facts (under `task`, so `--allow-change task` releases it).
DATA_PREFIX = "task.data."
#: Key prefix of the reward files' facts (reported when they change, never refused).
REWARD_PREFIX = "reward_file."
#: Words that mark a `task.options` entry as naming data.
DATA_WORDS = ("path", "file", "data")


def file_facts(path: Path) -> dict[str, Any]:
    """Size in bytes and SHA-256 of a file, or of every file under a directory (by name)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        size, sha256 = sha256_files(files, root=path)
    else:
        size, sha256 = sha256_files([path])
    return {"size": size, "sha256": sha256}


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


def data_files(options: dict[str, Any]) -> dict[str, Path]:
    """`task.options` entries naming a local file or directory of data: option → path."""
    found: dict[str, Path] = {}
    for key, value in options.items():
        if not any(word in key.lower() for word in DATA_WORDS):
            continue
        paths = [Path(text).expanduser() for text in _strings(value) if text]
        paths = [p for p in paths if p.is_file() or p.is_dir()]
        for i, path in enumerate(paths):
            found[key if len(paths) == 1 else f"{key}.{i}"] = path
    return found


def reward_source(ref: str) -> Path | None:
    """The file a `file.py:fn` or `module:fn` reference is loaded from (`None`: a name)."""
    target, sep, _name = ref.rpartition(":")
    if not sep or not target:
        return None
    if target.endswith(".py"):
        path = Path(target).expanduser()
        return path if path.is_file() else None
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and Path(origin).is_file() else None


def reward_refs(plain: dict[str, Any]) -> list[str]:
    """Every reward or environment reference of an unstructured config."""
    task = plain.get("task") or {}
    refs = [task.get("reward")] + [entry.get("fn") for entry in task.get("rewards") or ()]
    agent = (plain.get("rollout") or {}).get("agent") or {}
    refs += [text for text in _strings(agent) if ":" in text]
    return [ref for ref in refs if isinstance(ref, str)]


def input_facts(plain: dict[str, Any]) -> dict[str, Any]:
    """The dataset's and the reward files' size and SHA-256, as fingerprint keys."""
    facts: dict[str, Any] = {}
    options = (plain.get("task") or {}).get("options") or {}
    for key, path in data_files(options).items():
        for name, value in file_facts(path).items():
            facts[f"{DATA_PREFIX}{key}.{name}"] = value
    for ref in reward_refs(plain):
        path = reward_source(ref)
        if path is not None:
            for name, value in file_facts(path).items():
                facts[f"{REWARD_PREFIX}{path.resolve()}.{name}"] = value
    return facts
