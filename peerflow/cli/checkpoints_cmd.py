"""`peerflow checkpoints RUN_DIR`: a run's checkpoints and whether each verifies.

    peerflow checkpoints RUN_DIR [--json]

Each checkpoint is checked against its manifest (every file's size and SHA-256):
`verified` (a resume may use it), `corrupt` (a file is missing, truncated or changed;
the problem is named), or `incomplete` (the save never finished: no manifest). The
newest verified one is marked as the one `peerflow train --resume RUN_DIR` continues from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peerflow.cli.options import add_json_flag, add_run_dir_argument
from peerflow.errors import ConfigError

HELP = "list a run's checkpoints and verify them"
DESCRIPTION = ("List the checkpoints of RUN_DIR with their status (verified, corrupt, "
               "incomplete), checking every file's size and SHA-256 against the manifest.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds RUN_DIR and `--json`."""
    add_run_dir_argument(parser, "a run directory")
    add_json_flag(parser, "print JSON instead of a table")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> int:
    """Prints the table (or JSON); returns 0, or 1 when no checkpoint verifies."""
    from peerflow.checkpoint import list_checkpoints
    from peerflow.checkpoint.store import checkpoints_root

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"peerflow checkpoints {args.run_dir!r}: no such directory.")
    infos = list_checkpoints(run_dir, check=True)
    verified = [i.step for i in infos if i.status == "verified"]
    rows = [{"step": i.step, "status": i.status, "bytes": _size(i.path), "path": str(i.path),
             "problem": i.verdict.problem if i.verdict else "",
             "resume": bool(verified) and i.step == verified[-1]} for i in infos]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"no checkpoints under {checkpoints_root(run_dir)}")
    else:
        print(f"{'step':>8}  {'status':<10}  {'size':>10}  path")
        for row in rows:
            note = "  <- --resume continues here" if row["resume"] else ""
            problem = f"  ({row['problem']})" if row["problem"] else ""
            print(f"{row['step']:>8}  {row['status']:<10}  {_human(row['bytes']):>10}  "
                  f"{row['path']}{problem}{note}")
    return 0 if verified else 1


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
