"""The one place that decides whether a checkpoint file may be unpickled.

A pickle runs code when it is loaded: `torch.load(weights_only=False)` of a crafted file
is code execution as whoever resumes, evaluates or exports the run (often root). PeerFlow
writes its own state as safetensors and JSON; what is still a pickle is a torch file an
engine writes itself (DeepSpeed's `*_states.pt`) or one PeerFlow 0.1.0 wrote
(Megatron's `megatron_optim_*.pt`). Every such file is read here, through torch's
`weights_only=True` unpickler (tensors, containers, numbers, strings, and the classes an
engine names in `checkpoint_globals`), and nothing else:

* `is_pickle(path)` — a torch zip file (`…/data.pkl`) or a bare pickle (first byte 0x80);
* `safe_load(path)` — `torch.load` with `weights_only=True`; a file the restricted
  unpickler refuses raises `UntrustedCheckpointError` naming the file and
  `--trust-checkpoint`, unless the checkpoint is trusted;
* `untrusted_file(directory)` — the first pickle under a directory that `safe_load`
  refuses (the manifest's `verify` calls it: resume, eval and export see one verdict,
  before any engine starts; it finds the pickles `is_pickle` recognises, so the
  loaders themselves never rely on it);
* `check_files(paths)` — every one of `paths` loads restricted, before a reader that
  does not (DeepSpeed's `zero_to_fp32`) opens them;
* `trusted()` / `trust_checkpoints()` — `--trust-checkpoint`: the environment variable
  `PEERFLOW_TRUST_CHECKPOINT=1`, set by the CLI so that every worker the launcher starts
  inherits it. Trusted, a refused file is loaded with `weights_only=False`: only for
  checkpoints you wrote yourself.

`checkpoint_globals` of a train engine class is a tuple of `"module:Name"` strings: the
classes its own checkpoint files hold (DeepSpeed's loss scaler, its ZeRO stage enum).
A check allows those of every registered train engine (`registered_globals`) unless told
otherwise; they are imported when a file is checked, so this module imports no engine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from peerflow.errors import ConfigError

#: Set to `1` by `--trust-checkpoint`; inherited by every worker process.
TRUST_ENV = "PEERFLOW_TRUST_CHECKPOINT"
#: The first bytes of a zip archive (torch's default format) and of a pickle (protocol 2+).
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_MAGIC = b"\x80"


class UntrustedCheckpointError(ConfigError):
    """A checkpoint file is a pickle that the restricted (`weights_only`) unpickler refuses."""


def trusted() -> bool:
    """Whether this process was told `--trust-checkpoint` (`PEERFLOW_TRUST_CHECKPOINT=1`)."""
    return os.environ.get(TRUST_ENV, "") == "1"


def trust_checkpoints(trust: bool = True) -> None:
    """Sets (or clears) `--trust-checkpoint` for this process and the workers it starts."""
    if trust:
        os.environ[TRUST_ENV] = "1"
    else:
        os.environ.pop(TRUST_ENV, None)


def is_pickle(path: str | Path) -> bool:
    """Whether `path` is a torch zip file holding a pickle, or a bare pickle."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return False
    if head.startswith(PICKLE_MAGIC):
        return True
    if head != ZIP_MAGIC:
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _resolve(names: Iterable[str]) -> list[Any]:
    """The objects `"module:Name"` strings name (a module that is not installed: skipped)."""
    found = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue  # its engine is not installed: none of its files can need it
    return found


def _refusal(path: Path, reason: str) -> str:
    """The error for `path`: torch's own reason (its line naming the global), and the fix."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    why = next((line for line in lines if "GLOBAL" in line or "global" in line.split()[:3]),
               lines[0] if lines else "refused")
    return (f"{path} is a pickle that the safe loader (torch weights_only) refuses "
            f"({why.rstrip('.')[:300]}); loading it could run code. PeerFlow never "
            "unpickles such a file unless told to: if you wrote this checkpoint yourself, "
            "pass --trust-checkpoint (PEERFLOW_TRUST_CHECKPOINT=1).")


def _restricted_load(path: str | Path, allowed: Sequence[str], **kwargs: Any) -> Any:
    """`torch.load(weights_only=True)` allowing `allowed`; raises `pickle.UnpicklingError`.

    Classes of modules not imported yet are imported only if the file needs more than the
    rest (checking a DeepSpeed file does not import DeepSpeed for a file that needs none).
    """
    import sys

    import torch

    ready = [name for name in allowed if name.partition(":")[0] in sys.modules]
    try:
        with torch.serialization.safe_globals(_resolve(ready)):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError:
        if len(ready) == len(allowed):
            raise
    with torch.serialization.safe_globals(_resolve(allowed)):
        return torch.load(path, weights_only=True, **kwargs)


def safe_load(path: str | Path, *, allowed: Sequence[str] = (), trust: bool | None = None,
              **kwargs: Any) -> Any:
    """`torch.load(path)` through the restricted unpickler (`weights_only=True`).

    Args:
        path: The torch file.
        allowed: `"module:Name"` classes the file may hold besides torch's own.
        trust: Load a refused file anyway, unrestricted (`None`: `trusted()`).
        **kwargs: Passed to `torch.load` (`map_location`, `mmap`).

    Raises:
        UntrustedCheckpointError: the restricted unpickler refused the file and it is not
            trusted; the message names the file and `--trust-checkpoint`.
    """
    import torch

    try:
        return _restricted_load(path, allowed, **kwargs)
    except pickle.UnpicklingError as exc:
        if not (trusted() if trust is None else trust):
            raise UntrustedCheckpointError(_refusal(Path(path), str(exc))) from None
    return torch.load(path, weights_only=False, **kwargs)


def _check(path: Path, allowed: Sequence[str]) -> str | None:
    """Why the restricted unpickler refuses `path` (`None`: it loads), reading no tensor data."""
    try:
        with contextlib.suppress(RuntimeError):  # mmap needs the zip format
            _restricted_load(path, allowed, mmap=True, map_location="cpu")
            return None
        _restricted_load(path, allowed, map_location="cpu")
    except pickle.UnpicklingError as exc:
        return _refusal(path, str(exc))
    return None


def pickles_under(directory: str | Path) -> Iterator[Path]:
    """Every pickle file under `directory` (recursively, sorted).

    A symlink to a regular file counts as that file (every loader follows it); one to
    anything else (a FIFO, a device) is never opened.
    """
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file() and is_pickle(path):
            yield path


def untrusted_file(directory: str | Path, *, allowed: Sequence[str] | None = None,
                   trust: bool | None = None) -> str | None:
    """The refusal of the first pickle under `directory` the safe loader refuses.

    Args:
        directory: A checkpoint directory (or one engine's part of it).
        allowed: `"module:Name"` classes its files may hold (`None`: every registered
            train engine's `checkpoint_globals`).
        trust: Accept every file (`None`: `trusted()`).

    Returns:
        The refusal message, naming the file and `--trust-checkpoint` (`None`: every
        pickle loads restricted, or the checkpoint is trusted).
    """
    if trusted() if trust is None else trust:
        return None
    for path in pickles_under(directory):
        allowed = registered_globals() if allowed is None else allowed
        problem = _check(path, allowed)
        if problem is not None:
            return problem
    return None


def check_files(paths: Iterable[str | Path], *, allowed: Sequence[str] = (),
                trust: bool | None = None) -> None:
    """Raises `UntrustedCheckpointError` for the first of `paths` the safe loader refuses.

    For an engine's own reader that unpickles with `weights_only=False` (DeepSpeed's
    `zero_to_fp32`): call it on every file that reader opens, first. Every path is
    checked, whatever its first bytes (`torch.load` also reads protocol 0 and 1 pickles,
    which `is_pickle` does not recognise).
    """
    if trusted() if trust is None else trust:
        return
    for path in paths:
        problem = _check(Path(path), allowed)
        if problem is not None:
            raise UntrustedCheckpointError(problem)


def registered_globals() -> tuple[str, ...]:
    """The `checkpoint_globals` of every registered train engine (`trainer.backend`)."""
    from peerflow.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("train_engine")
    names: dict[str, None] = {}
    for name in registry.names():
        names.update(dict.fromkeys(getattr(registry.get(name), "checkpoint_globals", ())))
    return tuple(names)
