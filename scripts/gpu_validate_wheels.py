"""The GPU validation kit's wheel folder: what it must hold, whether it fits, filling it.

The device machine has no package registry, so the kit brings `WHEELS` in a local folder
that travels with the working tree (at most `TRANSFER_LIMIT` bytes together).
`prepare_wheels` fills the folder on a CPU machine with a registry.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The checkout (the kit runs its commands there).
ROOT = Path(__file__).resolve().parents[1]
#: Bytes that may travel with the working tree to the device (64 MiB).
TRANSFER_LIMIT = 64 * 2**20
PYTHON_TAG = "3.12"  # the GPU images seen so far

#: Wheels to bring, by group: (project name, pip requirement). PeerFlow is installed with
#: `--no-deps`, so only what its checks import is needed; `datasets`, `tensorboard` and
#: `matplotlib` (tens of MB) are left out: the checks do not use them.
WHEELS: dict[str, list[tuple[str, str]]] = {
    "core": [("pluggy", "pluggy>=1.5"), ("attrs", "attrs>=23.1"), ("pyyaml", "pyyaml"),
             ("rich", "rich"), ("markdown-it-py", "markdown-it-py"), ("mdurl", "mdurl"),
             ("pygments", "pygments")],
    "tests": [("pytest", "pytest>=8"), ("iniconfig", "iniconfig"), ("pluggy", "pluggy>=1.5"),
              ("pytest-timeout", "pytest-timeout"), ("hypothesis", "hypothesis"),
              ("sortedcontainers", "sortedcontainers")],
    "deepspeed": [("deepspeed", "deepspeed==0.19.8"), ("hjson", "hjson"),
                  ("py-cpuinfo", "py-cpuinfo"), ("ninja", "ninja"), ("msgpack", "msgpack"),
                  ("pydantic", "pydantic>=2"), ("pydantic-core", "pydantic-core"),
                  ("annotated-types", "annotated-types"),
                  ("typing-inspection", "typing-inspection"), ("einops", "einops")],
    "megatron": [("megatron-core", "megatron-core==0.16.1")],
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def find_wheels(folder: Path) -> dict[str, Path]:
    """Distribution files in `folder` by normalised project name."""
    found: dict[str, Path] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        if path.suffix == ".whl" or path.name.endswith((".tar.gz", ".zip")):
            stem = path.name.split("-")
            found[_norm(stem[0])] = path
    return found


def check_wheel_folder(folder: Path) -> dict[str, Any]:
    """What the folder holds against `WHEELS`, and whether it fits the transfer limit."""
    found = find_wheels(folder)
    groups = {group: [n for n, _ in items if _norm(n) not in found]
              for group, items in WHEELS.items()}
    size = sum(p.stat().st_size for p in found.values())
    tree = _tracked_bytes()
    return {"folder": str(folder), "files": sorted(p.name for p in found.values()),
            "bytes": size, "tree_bytes": tree, "fits_transfer_limit": size + tree
            <= TRANSFER_LIMIT, "missing": {g: m for g, m in groups.items() if m}}


def _tracked_bytes() -> int:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                               check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((ROOT / n.decode()).stat().st_size for n in names
               if n and (ROOT / n.decode()).is_file())


def prepare_wheels(folder: Path) -> int:
    """Downloads `WHEELS` for the GPU image's Python into `folder` (needs a registry)."""
    folder.mkdir(parents=True, exist_ok=True)
    specs = {spec for items in WHEELS.values() for name, spec in items
             if name != "deepspeed"}
    binary = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder),
              "--python-version", PYTHON_TAG, "--platform", "manylinux2014_x86_64",
              "--platform", "manylinux_2_17_x86_64", "--only-binary=:all:", *sorted(specs)]
    source = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder),
              "--no-binary=:all:", dict(WHEELS["deepspeed"])["deepspeed"]]
    for argv in (binary, source):
        print("$", " ".join(argv), flush=True)
        if subprocess.run(argv).returncode:
            return 1
    print(json.dumps(check_wheel_folder(folder), indent=2))
    return 0
