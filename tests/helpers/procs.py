"""Process helpers for tests that start their own launcher."""

from __future__ import annotations

import os
from pathlib import Path

#: Variables a launcher started by a test must not inherit from the test's own process.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "PEERFLOW_FAULT_STORE", "PEERFLOW_LAUNCHER_PID")


def launcher_env(program_dir: Path) -> dict[str, str]:
    """The environment of a test's launcher: `program_dir` importable, one thread, loopback
    gloo, and none of the variables of an enclosing launch."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{program_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for key in LAUNCH_VARIABLES:
        env.pop(key, None)
    return env


def program_launch(tmp_path: Path, module: str, program: str) -> tuple[Path, dict[str, str]]:
    """Writes `program` as `tmp_path/<module>.py` for a launcher's `entry="<module>:…"`.

    Returns:
        An empty run directory (`tmp_path/run`) and the launcher's environment
        (`launcher_env`, with `tmp_path` importable).
    """
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / f"{module}.py").write_text(program)
    return run_dir, launcher_env(tmp_path)
