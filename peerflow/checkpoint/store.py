"""The checkpoints of a run directory: where they live, which verify, which to keep.

    RUN_DIR/checkpoints/step_000040/
        actor/ critic/          each trainable role's engine `save_checkpoint` output
        driver/rank{r}.json     per saving rank: step, RNG state, prompt-sampler cursor
        inflight.json           async runs: which prompt groups were trained (optional)
        MANIFEST.json           every file's size and SHA-256, written last

A resume takes the newest checkpoint that verifies against its manifest; each newer one
that does not is reported (step and file), and the fallback is said out loud. A checkpoint
holding a pickle the safe loader refuses is not skipped but refused
(`UntrustedCheckpointError`, naming the file and `--trust-checkpoint`): someone other than
the run wrote into it, and the operator decides.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from peerflow.checkpoint.manifest import MANIFEST, Verdict, verify
from peerflow.checkpoint.pickles import UntrustedCheckpointError

CHECKPOINTS = "checkpoints"
PREFIX = "step_"


@attrs.frozen(kw_only=True)
class CheckpointInfo:
    """One step directory under `RUN_DIR/checkpoints` and whether it verifies."""

    step: int
    """The training step it was taken after."""
    path: Path
    """Its directory."""
    verdict: Verdict | None = None
    """The verification outcome (`None`: not verified yet)."""

    @property
    def status(self) -> str:
        """`verified`, `incomplete` (no manifest), `corrupt`, `untrusted`, or `unverified`."""
        if self.verdict is None:
            return "unverified"
        if self.verdict.ok:
            return "verified"
        if self.verdict.untrusted:
            return "untrusted"
        return "incomplete" if not (self.path / MANIFEST).is_file() else "corrupt"


def checkpoints_root(run_dir: str | Path) -> Path:
    """Returns `RUN_DIR/checkpoints`."""
    return Path(run_dir) / CHECKPOINTS


def run_and_step(directory: str | Path) -> tuple[Path, int | None]:
    """`(run directory, step)` of a run directory or one of its `checkpoints/step_N` ones.

    A run directory gives `(it, None)`; `RUN_DIR/checkpoints/step_000050` gives
    `(RUN_DIR, 50)`.
    """
    path = Path(directory)
    name = path.name
    if path.parent.name == CHECKPOINTS and name.startswith(PREFIX) and \
            name[len(PREFIX):].isdigit():
        return path.parent.parent, int(name[len(PREFIX):])
    return path, None


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Returns the directory of the checkpoint taken after `step`."""
    return checkpoints_root(run_dir) / f"{PREFIX}{step:06d}"


def list_checkpoints(run_dir: str | Path, *, check: bool = False) -> list[CheckpointInfo]:
    """Returns every step directory of `run_dir`, oldest first.

    Args:
        run_dir: The run directory.
        check: Verify each against its manifest (reads every byte).
    """
    root = checkpoints_root(run_dir)
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        if child.is_dir() and child.name.startswith(PREFIX) and child.name[5:].isdigit():
            found.append(CheckpointInfo(step=int(child.name[5:]), path=child,
                                        verdict=verify(child) if check else None))
    return sorted(found, key=lambda info: info.step)


def newest_complete(run_dir: str | Path) -> CheckpointInfo | None:
    """The newest checkpoint whose save finished (it has a manifest; checksums not read)."""
    complete = [i for i in list_checkpoints(run_dir) if (i.path / MANIFEST).is_file()]
    return complete[-1] if complete else None


def newest_verified(
    run_dir: str | Path, report: Callable[[str], None] = print, *,
    allowed: Sequence[str] | None = None, trust: bool | None = None,
) -> CheckpointInfo | None:
    """Returns the newest checkpoint that verifies, reporting every newer one that does not.

    Args:
        run_dir: The run directory.
        report: Called with one line per checkpoint skipped, and one naming the fallback.
        allowed: `"module:Name"` classes its pickles may hold (`verify`; `None`: every
            registered train engine's).
        trust: `--trust-checkpoint` (`None`: the process's setting).

    Raises:
        UntrustedCheckpointError: the newest complete checkpoint holds a pickle the safe
            loader refuses (never skipped for an older one).
    """
    skipped = []
    for info in reversed(list_checkpoints(run_dir)):
        verdict = verify(info.path, allowed=allowed, trust=trust)
        if verdict.untrusted:
            raise UntrustedCheckpointError(f"checkpoint of step {info.step} ({info.path}): "
                                           f"{verdict.problem}")
        if verdict.ok:
            if skipped:
                report(f"resuming from step {info.step} ({info.path}), the newest verified "
                       f"checkpoint, instead of step {skipped[0]}.")
            return attrs.evolve(info, verdict=verdict)
        skipped.append(info.step)
        report(f"checkpoint of step {info.step} ({info.path}) fails verification: "
               f"{verdict.problem}; skipping it.")
    return None


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Removes checkpoints older than the newest `keep_last` complete ones (0: keep all).

    A checkpoint counts as complete when it has a manifest (checksums are not re-read
    here; the leader calls this right after writing the newest manifest).

    Returns:
        The directories removed.
    """
    if keep_last <= 0:
        return []
    infos = list_checkpoints(run_dir)
    complete = [i for i in infos if (i.path / MANIFEST).is_file()]
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[-keep_last].step
    removed = [i.path for i in infos if i.step < oldest_kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
