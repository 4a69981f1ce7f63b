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


def crafted_copy(ckpt: str | Path, target: str, *, remove: tuple[str, ...] = ()) -> dict:
    """Loads a crafted copy of engine checkpoint `ckpt`'s directory (every rank calls).

    Rank 0 copies `ckpt` to `ckpt-crafted`, deletes its files `remove` (to make the loader
    read `target`) and plants `Payload` in `target` (relative to the copy); then each rank
    returns a function `load(engine)` → the `UntrustedCheckpointError` message, or `None`
    if it loaded. Returns `{"path": the copy, "target": …, "marker": …, "load": load}`.
    """
    import shutil

    import torch.distributed as dist

    copy = Path(f"{ckpt}-crafted")
    marker = copy.parent / f"{copy.name}-pwned"
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, copy)
        for name in remove:
            (copy / name).unlink()
        plant(copy / target, marker)
    dist.barrier()

    def load(engine) -> str | None:
        from peerflow.checkpoint.pickles import UntrustedCheckpointError

        try:
            engine.load_checkpoint(str(copy))
        except UntrustedCheckpointError as exc:
            return str(exc)
        return None

    return {"path": copy, "target": str(copy / target), "marker": marker, "load": load}
