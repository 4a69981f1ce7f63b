"""The GPU validation kit's wheel folder: what it holds, filling it, what to install from it.

The device machine has no package registry, so the kit brings `WHEELS` in a local folder
that travels with the working tree (at most `TRANSFER_LIMIT` bytes together).
`prepare_wheels` fills the folder on a CPU machine with a registry; on the GPU machine
`plan_install` picks from it only what the image lacks (a distribution that is absent, or
installed at a version that does not satisfy the kit's need or a requirement of another
wheel being installed), so the image's own packages (pytest, pluggy, attrs at a good
version, …) are never reinstalled.

Standard library only (the kit starts on a bare image); requirement strings are parsed with
`packaging`, or pip's vendored copy where the image lacks it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - an image without packaging still has pip
    from pip._vendor.packaging.requirements import (  # type: ignore[no-redef]
        InvalidRequirement,
        Requirement,
    )
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

#: The checkout (the kit runs its commands there).
ROOT = Path(__file__).resolve().parents[1]
#: Bytes that may travel with the working tree to the device (64 MiB).
TRANSFER_LIMIT = 64 * 2**20
#: The GPU images seen so far (the H200 of 2026-11-27 too) run CPython 3.12 on x86_64.
PYTHON_TAG = "3.12"
#: Platform tags asked of pip, newest first. Megatron-core 0.16.1 ships only
#: `manylinux_2_24`/`manylinux_2_28` wheels for cp312; pydantic-core and rpds-py ship
#: `manylinux_2_17` (= `manylinux2014`) ones.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")


@dataclass(frozen=True)
class Wheel:
    """One distribution the folder brings."""

    name: str
    need: str = ""
    """Specifier an installed copy must satisfy to be kept ('' = any version)."""
    pin: str = ""
    """Version downloaded ('' = the newest satisfying `need`); pinned where verified on a
    GPU image (2026-11-27, H200) or where one wheel pins another (pydantic-core)."""
    source: bool = False
    """Brought as its source package and built there (DeepSpeed, `DS_BUILD_OPS=0`)."""

    @property
    def spec(self) -> str:
        """The requirement `pip download` is given."""
        return f"{self.name}=={self.pin}" if self.pin else f"{self.name}{self.need}"


#: Wheels to bring, by group. PeerFlow itself is installed from the checkout with
#: `--no-deps`, so this lists its runtime dependencies (pyproject.toml) and theirs that a
#: CUDA image may lack — the H200 image of 2026-11-27 lacked cattrs, pebble, jsonschema
#: (+ referencing, rpds-py, jsonschema-specifications), math-verify (+ latex2sympy2_extended,
#: antlr4-python3-runtime), datasets (+ dill, multiprocess), and had a typing_extensions
#: older than pydantic 2.14 needs (4.16) and an attrs older than cattrs 26 needs (25.4).
#: torch, transformers, tokenizers, safetensors, numpy, pyarrow, pandas, tensorboard and
#: matplotlib are the image's (large; never brought).
WHEELS: dict[str, list[Wheel]] = {
    "core": [
        Wheel("pluggy", ">=1.5"), Wheel("attrs", ">=25.4", "26.1.0"),
        Wheel("cattrs", ">=23.1", "26.2.1"), Wheel("pyyaml"), Wheel("rich"),
        Wheel("markdown-it-py"), Wheel("mdurl"), Wheel("pygments"),
        Wheel("typing-extensions", ">=4.16", "4.16.0"),
        Wheel("pebble", ">=5", "5.2.3"),
        Wheel("math-verify", ">=0.7", "0.9.0"),
        Wheel("latex2sympy2-extended", "", "1.11.0"),
        Wheel("antlr4-python3-runtime", "", "4.13.2"),
        Wheel("jsonschema", ">=4", "4.26.0"), Wheel("referencing", "", "0.37.0"),
        Wheel("rpds-py", "", "2026.9.1"),
        Wheel("jsonschema-specifications", "", "2025.9.1"),
        Wheel("datasets", "", "5.2.0"), Wheel("dill", "", "0.4.1"),
        Wheel("multiprocess", "", "0.70.19"),
        Wheel("msgpack", ">=1.2.4"), Wheel("pyseccomp", ">=0.1.2"),
    ],
    "tests": [Wheel("pytest", ">=8"), Wheel("iniconfig"), Wheel("pytest-timeout"),
              Wheel("hypothesis"), Wheel("sortedcontainers")],
    "deepspeed": [
        Wheel("deepspeed", "==0.19.8", "0.19.8", source=True), Wheel("hjson", "", "3.1.0"),
        Wheel("py-cpuinfo"), Wheel("ninja"), Wheel("einops"),
        Wheel("pydantic", ">=2", "2.14.4"), Wheel("pydantic-core", "", "2.50.5"),
        Wheel("annotated-types", "", "0.8.0"), Wheel("typing-inspection", "", "0.4.5"),
    ],
    "megatron": [Wheel("megatron-core", "==0.16.1", "0.16.1")],
}


def norm(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def all_wheels() -> dict[str, Wheel]:
    """Every entry of `WHEELS` by normalised name (one entry per project)."""
    return {norm(w.name): w for items in WHEELS.values() for w in items}


def find_wheels(folder: Path) -> dict[str, Path]:
    """Distribution files in `folder` by normalised project name."""
    found: dict[str, Path] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        if path.suffix == ".whl" or path.name.endswith((".tar.gz", ".zip")):
            found[norm(_split_name(path.name)[0])] = path
    return found


def _split_name(filename: str) -> tuple[str, str]:
    """(project, version) of a wheel or source package file name."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return parts[0], parts[1] if len(parts) > 1 else ""
    stem = re.sub(r"\.(tar\.gz|zip)$", "", filename)
    name, _, version = stem.rpartition("-")
    return (name, version) if name else (stem, "")


def file_version(path: Path) -> str:
    """The version a distribution file carries in its name."""
    return _split_name(path.name)[1]


def requires_dist(path: Path) -> list[str]:
    """`Requires-Dist` of a wheel (its METADATA) or a source package (its PKG-INFO)."""
    text = ""
    try:
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as zf:
                meta = [n for n in zf.namelist()
                        if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
                text = zf.read(meta[0]).decode("utf-8", "replace") if meta else ""
        elif path.name.endswith(".tar.gz"):
            with tarfile.open(path) as tf:
                info = [m for m in tf.getmembers() if m.name.count("/") == 1
                        and m.name.endswith("/PKG-INFO")]
                handle = tf.extractfile(info[0]) if info else None
                text = handle.read().decode("utf-8", "replace") if handle else ""
    except (OSError, zipfile.BadZipFile, tarfile.TarError, KeyError):
        return []
    return HeaderParser().parsestr(text).get_all("Requires-Dist") or []


def check_wheel_folder(folder: Path) -> dict[str, Any]:
    """What the folder holds against `WHEELS`, and whether it fits the transfer limit."""
    found = find_wheels(folder)
    groups = {group: [w.name for w in items if norm(w.name) not in found]
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


def satisfies(version: str | None, specifier: str) -> bool:
    """Whether an installed `version` (None: absent) satisfies `specifier`."""
    if version is None:
        return False
    if not specifier:
        return True
    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _applies(req: Requirement) -> bool:
    if req.marker is None:
        return True
    try:
        return bool(req.marker.evaluate({"extra": ""}))
    except Exception:  # noqa: BLE001 - an unknown marker variable: not for this image
        return False


@dataclass
class InstallPlan:
    """What to install from the folder on this image, and why."""

    install: dict[str, str] = field(default_factory=dict)
    """Normalised name → why it is installed (absent / too old / required by …)."""
    kept: dict[str, str] = field(default_factory=dict)
    """Normalised name → the image's version, kept (it satisfies every need)."""
    unsatisfied: list[str] = field(default_factory=list)
    """Requirements of installed wheels that neither the image nor the folder meets."""


def plan_install(folder: dict[str, Path], installed: dict[str, str],
                 requires: dict[str, list[str]] | None = None) -> InstallPlan:
    """Picks from the folder only what the image lacks.

    Args:
        folder: The folder's files by normalised name (`find_wheels`).
        installed: The image's distributions, normalised name → version.
        requires: `Requires-Dist` strings by normalised name (default: read from the files).

    A file is installed when its project is absent, installed at a version that fails the
    kit's `need`, or required (by a file being installed) at a version the image's copy
    does not satisfy; otherwise the image's copy is kept.
    """
    wanted = all_wheels()
    installed = {norm(k): v for k, v in installed.items()}
    if requires is None:
        requires = {name: requires_dist(path) for name, path in folder.items()}
    plan = InstallPlan()
    for name in folder:
        have = installed.get(name)
        need = wanted[name].need if name in wanted else ""
        if have is None:
            plan.install[name] = "absent"
        elif not satisfies(have, need):
            plan.install[name] = f"installed {have} fails {need}"
        else:
            plan.kept[name] = have
    todo = list(plan.install)
    while todo:  # what the files being installed require, transitively
        name = todo.pop()
        for text in requires.get(name, []):
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            dep = norm(req.name)
            if not _applies(req) or dep in plan.install:
                continue
            spec = str(req.specifier)
            if satisfies(installed.get(dep), spec):
                continue
            if dep in folder and (not spec or satisfies(file_version(folder[dep]), spec)):
                plan.install[dep] = f"{name} requires {dep}{spec}" + (
                    f" (installed {installed[dep]})" if dep in installed else "")
                plan.kept.pop(dep, None)
                todo.append(dep)
            else:
                plan.unsatisfied.append(f"{name} requires {req}: installed "
                                        f"{installed.get(dep, 'none')}, folder "
                                        f"{file_version(folder[dep]) if dep in folder else 'none'}")
    return plan


def installed_distributions(python: str = sys.executable) -> dict[str, str]:
    """The distributions `python` sees (a fresh process: no stale metadata cache)."""
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: "
            "d.version for d in m.distributions() if d.metadata['Name']}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return {norm(k): v for k, v in json.loads(out.stdout).items()}


def download_commands(folder: Path, python: str = sys.executable) -> list[list[str]]:
    """The `pip download` commands that fill `folder`: binaries, then the source packages.

    `--no-deps`: `WHEELS` lists every distribution explicitly (resolving would pull torch and
    CUDA wheels); `--only-binary=:all:` with the image's Python and the manylinux platforms.
    """
    entries = [w for items in WHEELS.values() for w in items]
    binary = sorted({w.spec for w in entries if not w.source})
    source = sorted({w.spec for w in entries if w.source})
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    pip = [python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(folder)]
    return [[*pip, "--python-version", PYTHON_TAG, *platforms, "--only-binary=:all:",
             *binary],
            [*pip, "--no-binary=:all:", *source]]


def prepare_wheels(folder: Path) -> int:
    """Downloads `WHEELS` for the GPU image's Python into `folder` (needs a registry)."""
    folder.mkdir(parents=True, exist_ok=True)
    for argv in download_commands(folder):
        print("$", " ".join(argv), flush=True)
        if subprocess.run(argv).returncode:
            return 1
    report = check_wheel_folder(folder)
    print(json.dumps(report, indent=2))
    print(f"{len(report['files'])} files, {report['bytes'] / 2**20:.1f} MiB "
          f"(+ tree {report['tree_bytes'] / 2**20:.1f} MiB; limit "
          f"{TRANSFER_LIMIT // 2**20} MiB)")
    return 0 if not report["missing"] and report["fits_transfer_limit"] else 1
