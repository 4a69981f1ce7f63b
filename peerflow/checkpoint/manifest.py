"""A checkpoint's manifest: every file's size and SHA-256, written last and atomically.

A step directory is a checkpoint only once `MANIFEST.json` exists; the manifest is the
last thing written (after every rank's files, behind a barrier), so its presence means
the save finished, and its sizes and checksums let a resume prove that nothing was
truncated or changed since. A checksum proves only that the files are the ones the
manifest lists, not who wrote them: `verify` also refuses a checkpoint holding a pickle
that the safe loader refuses (`peerflow.checkpoint.pickles`), unless it is trusted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from peerflow.checkpoint.atomic import write_json_atomic
from peerflow.checkpoint.pickles import untrusted_file
from peerflow.digests import sha256_file

MANIFEST = "MANIFEST.json"
FORMAT = "peerflow-checkpoint/1"


@attrs.frozen(kw_only=True)
class Verdict:
    """The outcome of verifying one checkpoint directory."""

    ok: bool
    """Whether every file the manifest lists is present with its size and checksum."""
    problem: str = ""
    """What is wrong, naming the file (empty when `ok`)."""
    untrusted: bool = False
    """A file is a pickle the safe loader refuses: the checkpoint is refused, not skipped."""


def _payload_files(directory: Path) -> list[Path]:
    """Every file of the checkpoint but the manifest and leftover temporaries."""
    return sorted(
        p for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST and ".tmp" not in p.name
    )


def write_manifest(directory: str | Path, *, step: int) -> Path:
    """Hashes every file under `directory` and writes `MANIFEST.json` (atomically, last).

    Args:
        directory: A checkpoint directory whose files are all written.
        step: The training step the checkpoint was taken after.

    Returns:
        The manifest's path.
    """
    directory = Path(directory)
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in _payload_files(directory)
    }
    return write_json_atomic(directory / MANIFEST, {"format": FORMAT, "step": step,
                                                     "files": files})


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """Returns the parsed manifest of `directory`, or `None` when it has none (or unreadable)."""
    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def verify(directory: str | Path, *, allowed: Sequence[str] | None = None,
           trust: bool | None = None) -> Verdict:
    """Checks every file the manifest lists: present, same size, same SHA-256, and safe.

    Files the manifest does not list are ignored (they were not part of the save).

    Args:
        directory: The checkpoint directory.
        allowed: `"module:Name"` classes its pickles may hold (`None`: every registered
            train engine's `checkpoint_globals`, `peerflow.checkpoint.pickles`).
        trust: `--trust-checkpoint` (`None`: `peerflow.checkpoint.pickles.trusted()`).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return Verdict(ok=False, problem=f"{MANIFEST} is missing or unreadable (the save "
                       "did not finish)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(w, dict) and type(w.get("bytes")) is int
            and isinstance(w.get("sha256"), str) for w in files.values()):
        return Verdict(ok=False, problem=f"{MANIFEST} is malformed (its files are not "
                       "{name: {bytes, sha256}}): not one PeerFlow wrote")
    for name, want in sorted(files.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return Verdict(ok=False, problem=f"{MANIFEST} lists {name!r}, outside the "
                           "checkpoint (a manifest PeerFlow wrote names its own files only)")
        path = directory / name
        if not path.is_file():
            return Verdict(ok=False, problem=f"{name} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            return Verdict(ok=False, problem=f"{name} has {size} bytes, the manifest says "
                           f"{want['bytes']} (truncated or rewritten)")
        if sha256_file(path) != want["sha256"]:
            return Verdict(ok=False, problem=f"{name} fails its SHA-256 checksum")
    problem = untrusted_file(directory, allowed=allowed, trust=trust)
    if problem is not None:
        return Verdict(ok=False, problem=problem, untrusted=True)
    return Verdict(ok=True)
