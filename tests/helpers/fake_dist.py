"""Builds installed-distribution folders (dist-info + modules) for plugin tests.

A folder on `sys.path` holding `NAME-VERSION.dist-info/entry_points.txt` is exactly what
`importlib.metadata` discovers for a pip-installed package, so a subprocess with that
folder on PYTHONPATH sees the plugin as installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def make_distribution(root: Path, name: str, modules: dict[str, str],
                      entry_points: dict[str, str], version: str = "1.0") -> Path:
    """Writes a distribution into `root` and returns `root`.

    Args:
        root: Folder to put on PYTHONPATH.
        name: Distribution name.
        modules: `module_name -> source`.
        entry_points: `entry point name -> module` in group `peerflow`.
        version: Distribution version.
    """
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[peerflow]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def run_peerflow(*args: str, pythonpath: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `python -m peerflow ARGS` in a subprocess and returns the completed process."""
    full_env = dict(os.environ)
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(pythonpath), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "peerflow", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout)
