"""The three launch modes: elastic (covered with failures in test_faults), torchrun, Ray."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from peerflow.distributed.init import free_port
from peerflow.errors import ConfigError
from peerflow.launch import launch

pytestmark = pytest.mark.distributed

PROGRAM = textwrap.dedent('''
    import os
    import torch, torch.distributed as dist
    from peerflow.distributed import dist_context, stage

    def run(config_path, overrides, run_dir, resume):
        ctx = dist_context()
        with stage("allreduce"):
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
        if os.environ.get("FAIL_RANK") == str(ctx.rank):
            with stage("reward"):
                raise RuntimeError("bad reward row 7")
        with open(os.path.join(run_dir, f"rank{ctx.rank}"), "w") as f:
            f.write(f"{ctx.world_size} {int(t.item())} {ctx.backend} {overrides}")
''')

SCRIPT = textwrap.dedent('''
    import sys
    from peerflow.errors import PeerFlowError
    from peerflow.launch import launch
    try:
        launch(None, ["a.b=1"], sys.argv[1], None, nprocs=int(sys.argv[2]),
               launcher=sys.argv[3], fault_timeout=20, entry="launchprog:run",
               torch_threads=1)
    except PeerFlowError as exc:
        print("LAUNCHER:", exc, file=sys.stderr)
        sys.exit(1)
''')


def _env(tmp_path, **extra):
    (tmp_path / "launchprog.py").write_text(PROGRAM)
    (tmp_path / "launch_script.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GLOO_SOCKET_IFNAME="lo", RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **extra)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PEERFLOW_FAULT_STORE"):
        env.pop(key, None)
    return env


def _results(tmp_path, n):
    return [(tmp_path / f"rank{r}").read_text() for r in range(n)]


def test_torchrun_runs_the_worker_in_process(tmp_path) -> None:
    """Under torchrun the environment describes the job: launch() runs the worker itself."""
    env = _env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         str(tmp_path / "launch_script.py"), str(tmp_path), "2", "elastic"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _results(tmp_path, 2) == ["2 3 gloo ['a.b=1']"] * 2


def test_ray_launcher_places_workers(tmp_path) -> None:
    pytest.importorskip("ray")
    env = _env(tmp_path, FAIL_RANK="1")
    proc = subprocess.run([sys.executable, str(tmp_path / "launch_script.py"), str(tmp_path),
                           "2", "ray"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    host = socket.gethostname()
    assert (f"LAUNCHER: rank 1 (host {host}) failed in stage 'reward': RuntimeError: bad reward "
            "row 7") in proc.stderr
    assert _results(tmp_path, 1) == ["2 3 gloo ['a.b=1']"]  # rank 0 ran to the end


def test_unknown_launcher_and_entry() -> None:
    with pytest.raises(ConfigError, match="--launcher 'slurm'"):
        launch(None, nprocs=1, launcher="slurm", fault_timeout=1, torch_threads=1)
    with pytest.raises(ValueError, match="expected 'module:function'"):
        launch(None, nprocs=1, fault_timeout=1, torch_threads=1, entry="nope")


WARM_PROGRAM = textwrap.dedent('''
    import os, sys

    def run(config_path, overrides, run_dir, resume):
        rank = os.environ["RANK"]
        with open(os.path.join(run_dir, f"rank{rank}"), "w") as f:
            f.write(f"{'peerflow.launch.preload' in sys.modules} "
                    f"{os.environ.get('LATE')} {'GONE' in os.environ}")
''')

WARM_SCRIPT = textwrap.dedent('''
    import multiprocessing, os, sys
    from peerflow.launch import launch
    from peerflow.launch.warm import start_warm_server

    if __name__ == "__main__":  # workers import this module as they start
        if sys.argv[2] == "taken":  # someone else's fork server: its environment is unknown
            multiprocessing.forkserver.ensure_running()
        print("warm:", start_warm_server())
        os.environ["LATE"] = "set after the server started"
        del os.environ["GONE"]
        launch(None, [], sys.argv[1], None, nprocs=2, fault_timeout=20,
               entry="warmprog:run", torch_threads=1)
''')


@pytest.mark.parametrize("server", ["ours", "taken"])
def test_elastic_workers_fork_from_the_warm_server_and_see_the_launchers_environment(
        tmp_path, server) -> None:
    """Workers start with torch imported where the launcher owns the fork server, else
    spawn; either way they see the launcher's environment as it is at launch."""
    (tmp_path / "warmprog.py").write_text(WARM_PROGRAM)
    (tmp_path / "warm_script.py").write_text(WARM_SCRIPT)
    env = _env(tmp_path, GONE="removed after the server started")
    proc = subprocess.run([sys.executable, str(tmp_path / "warm_script.py"), str(tmp_path),
                           server], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    warm = server == "ours"
    assert f"warm: {warm}" in proc.stdout
    assert _results(tmp_path, 2) == [f"{warm} set after the server started False"] * 2
