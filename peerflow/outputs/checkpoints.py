"""Checkpoint helpers: safetensors + JSON metadata, written atomically.

A checkpoint is a directory written under a temporary name and renamed into place
(`atomic_directory`), so a crash never leaves a half-written checkpoint under its final
name; `latest` is a small file naming the newest complete one (`update_latest`). The
worker decides when (`should_checkpoint`) and what (each engine's own state).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yields a temporary directory next to `final`, renamed to `final` on success.

    On an exception the temporary directory is removed and `final` is untouched. An
    existing `final` is replaced (the old one is removed only after the new one is
    complete).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_tensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None = None
) -> None:
    """Writes `tensors` to `path` (safetensors) and `metadata` to `path` + `.json`.

    Both files go through a temporary name and a rename. Tensors are made contiguous and
    moved to CPU; shared storage is copied (safetensors refuses aliasing).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(cpu, str(tmp))
    os.replace(tmp, path)
    if metadata is not None:
        meta_path = path.with_name(path.name + ".json")
        meta_tmp = meta_path.with_name(f".{meta_path.name}.tmp{os.getpid()}")
        meta_tmp.write_text(json.dumps(dict(metadata), indent=1, sort_keys=True, default=str))
        os.replace(meta_tmp, meta_path)


def load_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Reads what `save_tensors` wrote: `(tensors, metadata or None)`."""
    from safetensors.torch import load_file

    path = Path(path)
    meta_path = path.with_name(path.name + ".json")
    metadata = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    return load_file(str(path)), metadata


def update_latest(root: str | Path, name: str) -> None:
    """Atomically points `root/latest` at the checkpoint directory `root/name`."""
    root = Path(root)
    tmp = root / f".{LATEST}.tmp{os.getpid()}"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def read_latest(root: str | Path) -> Path | None:
    """Returns the directory `root/latest` names, or `None` when there is none yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    target = Path(root) / pointer.read_text().strip()
    return target if target.is_dir() else None


def should_checkpoint(step: int, every: int, total_steps: int) -> bool:
    """Whether to save after `step`: every `every` steps (0: never) and after the last."""
    return step == total_steps or (every > 0 and step % every == 0)
