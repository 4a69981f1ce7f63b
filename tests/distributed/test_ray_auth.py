"""A local Ray the launcher starts runs code only for callers with its token (issue 49).

Ray's services listen on every interface whatever address they are given. Before, the
launcher started a local Ray with `RAY_AUTH_MODE=disabled`: a process on another machine
joined it as a driver (`ray.init(address=<gcs>)`) and ran a task on the node (as root,
where the run was). Now the launcher starts it with `RAY_AUTH_MODE=token` and a fresh
token, which its actors inherit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.distributed

PROGRAM = textwrap.dedent('''
    import os, time
    from peerflow.distributed import dist_context

    def run(config_path, overrides, run_dir, resume):
        if dist_context().rank == 0:
            import ray
            gcs = ray.get_runtime_context().gcs_address
            with open(os.path.join(run_dir, "gcs"), "w") as f:
                f.write(gcs)
            deadline = time.time() + 60
            while not os.path.exists(os.path.join(run_dir, "tried")) and time.time() < deadline:
                time.sleep(0.2)
        with open(os.path.join(run_dir, f"rank{dist_context().rank}"), "w") as f:
            f.write("done")
''')

SCRIPT = textwrap.dedent('''
    import sys
    from peerflow.launch import launch
    launch(None, [], sys.argv[1], None, nprocs=2, launcher="ray", fault_timeout=30,
           entry="rayauthprog:run", torch_threads=1)
''')

STRANGER = textwrap.dedent('''
    import sys, ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False)
        @ray.remote
        def g():
            return "ran code on the node"
        print("STRANGER:", ray.get(g.remote(), timeout=30))
    except Exception as exc:
        print("STRANGER REFUSED:", type(exc).__name__)
''')


CHECK = textwrap.dedent('''
    import os
    from peerflow.launch.ray_launcher import local_ray_auth
    local_ray_auth()
    print(os.environ["RAY_AUTH_MODE"], len(os.environ.get("RAY_AUTH_TOKEN", "")))
''')


@pytest.mark.parametrize(("given", "got"), [({}, "token 64"),
                                            ({"RAY_AUTH_MODE": "disabled"}, "disabled 0")],
                         ids=["unset", "the operator's choice"])
def test_the_launcher_gives_a_local_ray_a_fresh_token(given, got) -> None:
    """In a fresh interpreter: the check may re-read Ray's settings in the process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run([sys.executable, "-c", CHECK], env={**env, **given},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[-2] == got, out.stdout + out.stderr


@pytest.mark.slow
def test_a_stranger_cannot_run_code_in_the_local_ray_of_a_run(tmp_path) -> None:
    """Slow (two Ray starts, ~30 s); `test_the_launcher_gives_a_local_ray_a_fresh_token`
    keeps the contract in the default run."""
    pytest.importorskip("ray")
    (tmp_path / "rayauthprog.py").write_text(PROGRAM)
    (tmp_path / "ray_auth_script.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PEERFLOW_FAULT_STORE",
                "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS"):
        env.pop(key, None)
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "ray_auth_script.py"),
                                 str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "gcs").exists() and time.time() < deadline:
            assert launcher.poll() is None, launcher.stdout.read()
            time.sleep(0.5)
        gcs = (tmp_path / "gcs").read_text()
        stranger = subprocess.run([sys.executable, "-c", STRANGER, gcs],
                                  env=dict(env, RAY_AUTH_MODE="disabled"), capture_output=True,
                                  text=True, timeout=120)
        (tmp_path / "tried").write_text("")
        assert "STRANGER REFUSED" in stranger.stdout, stranger.stdout + stranger.stderr
        assert launcher.wait(timeout=120) == 0, launcher.stdout.read()
        assert (tmp_path / "rank1").read_text() == "done"
    finally:
        if launcher.poll() is None:
            launcher.kill()
