"""Workers import the installed PeerFlow, never a `peerflow/` folder in the working directory.

An author who clones PeerFlow and writes a plugin beside the clone runs from the clone's
parent, which holds a `peerflow/` folder. A worker that put its working directory first on
`sys.path` would import that folder instead of the installed package (issue 40).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

import peerflow
from tests.helpers.procs import launcher_env

pytestmark = pytest.mark.distributed

PROGRAM = textwrap.dedent('''
    import os
    import peerflow

    def run(config_path, overrides, run_dir, resume):
        with open(os.path.join(run_dir, "rank" + os.environ["RANK"]), "w") as f:
            f.write(f"{os.path.dirname(peerflow.__file__)} {hasattr(peerflow, 'RolloutEngine')}")
''')

SCRIPT = textwrap.dedent('''
    import multiprocessing.forkserver, sys
    from peerflow.launch import launch

    if __name__ == "__main__":
        if sys.argv[2] == "spawn":  # someone else's fork server: the launcher spawns workers
            multiprocessing.forkserver.ensure_running()
        launch(None, [], sys.argv[1], None, nprocs=2, fault_timeout=30,
               entry="cwdprog:run", torch_threads=1)
''')



def _decoy(workdir, kind: str) -> None:
    """A `peerflow/` folder: a clone (a namespace package to Python) or a broken package."""
    if kind == "clone":
        (workdir / "peerflow" / "peerflow").mkdir(parents=True)
        (workdir / "peerflow" / "pyproject.toml").write_text("[project]\nname = 'peerflow'\n")
    else:
        (workdir / "peerflow").mkdir(parents=True)
        (workdir / "peerflow" / "__init__.py").write_text(
            'raise ImportError("the peerflow/ folder of the working directory was imported")\n')


# slow-tier: the package decoy and spawn; ("forkserver", "clone") keeps the contract
@pytest.mark.parametrize("start,decoy", [
    ("forkserver", "clone"), pytest.param("forkserver", "package", marks=pytest.mark.slow),
    pytest.param("spawn", "clone", marks=pytest.mark.slow)])
def test_workers_ignore_a_peerflow_folder_in_the_working_directory(tmp_path, start,
                                                                   decoy) -> None:
    """Run from a folder holding a `peerflow/` folder, every worker imports the real one.

    A clone's folder is a namespace package to Python: imported first, it would hide the
    installed package's `__init__` (no `peerflow.RolloutEngine`, every plugin failing).
    """
    program = tmp_path / "program"
    program.mkdir()
    (program / "cwdprog.py").write_text(PROGRAM)
    (program / "cwd_script.py").write_text(SCRIPT)
    workdir = tmp_path / "parent-of-a-clone"
    _decoy(workdir, decoy)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = launcher_env(program)
    env["PYTHONPATH"] = str(program)  # an empty entry would put the working directory first
    proc = subprocess.run([sys.executable, str(program / "cwd_script.py"), str(run_dir), start],
                          cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    installed = str(peerflow.__path__[0])
    assert [(run_dir / f"rank{r}").read_text() for r in range(2)] == [f"{installed} True"] * 2


def test_a_worker_that_imported_a_folder_as_peerflow_says_so(monkeypatch, tmp_path) -> None:
    """Other launchers (torchrun -m, Ray) may still put the working directory first."""
    from peerflow.launch.entry import check_installed_peerflow

    check_installed_peerflow()  # the real package: nothing to say
    folder = types.ModuleType("peerflow")
    folder.__path__ = [str(tmp_path / "peerflow")]  # a namespace package has no __file__
    monkeypatch.setitem(sys.modules, "peerflow", folder)
    with pytest.raises(ImportError, match=r"imported the folder .*peerflow as `peerflow`"):
        check_installed_peerflow()
