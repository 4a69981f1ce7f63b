"""The launcher is killed with SIGKILL (the OOM killer, a wrong `kill -9`): its workers exit
within about a second, quietly, and the run lock refuses a resume until they are gone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from peerflow.distributed.procs import process_gone
from peerflow.errors import ConfigError
from peerflow.outputs import RunLock
from tests.helpers.procs import program_launch

pytestmark = pytest.mark.distributed

PROGRAM = textwrap.dedent('''
    import os, time
    import torch, torch.distributed as dist

    def run(config_path, overrides, run_dir, resume):
        rank = dist.get_rank()
        path = os.path.join(run_dir, f"alive{rank}")
        while True:  # trains on; the last timestamp written is (about) when it ended
            t = torch.ones(1)
            dist.all_reduce(t)
            with open(path + ".tmp", "w") as f:
                f.write(str(time.time()))
            os.replace(path + ".tmp", path)
            time.sleep(0.05)
''')

LAUNCHER = textwrap.dedent('''
    import sys
    from pathlib import Path
    from peerflow.launch import launch
    from peerflow.outputs import RunLock
    with RunLock(Path(sys.argv[1])):  # as `peerflow train` holds it
        launch(None, [], sys.argv[1], None, nprocs=2, launcher="elastic",
               fault_timeout=30.0, entry="lifeprog:run", torch_threads=1)
''')


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_workers_exit_when_the_launcher_is_killed_and_the_lock_waits_for_them(tmp_path):
    run_dir, env = program_launch(tmp_path, "lifeprog", PROGRAM)
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir)], env=env,
                                    stdout=err, stderr=err)
    try:
        lock = run_dir / "run.lock"
        _wait_for(lambda: all((run_dir / f"alive{r}").is_file() for r in (0, 1)), 240,
                  "two workers training")
        holder = json.loads(lock.read_text())
        assert holder["pid"] == launcher.pid
        workers = holder.get("workers", [])
        assert len(workers) == 2, holder  # the lock names every local worker
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        t_kill = time.time()

        def gone() -> bool:
            return all(process_gone(pid) for pid in workers)  # a zombie has ended

        refused = []
        while True:  # a resume started at once: refused while any worker lives
            alive_before = not gone()
            try:
                RunLock(run_dir, log=lambda _line: None).acquire().release()
            except ConfigError as exc:
                refused.append(str(exc))
                assert time.time() - t_kill < 10, "workers outlived their launcher"
                time.sleep(0.02)
                continue
            assert not alive_before or gone(), "the lock was taken over beside live workers"
            break
        t_gone = time.time()
        assert all("launcher that is gone" in text for text in refused), refused[:1]
        last = max(float((run_dir / f"alive{r}").read_text()) for r in (0, 1))
        assert last - t_kill < 3.0, last - t_kill  # trained on for at most a moment
        assert t_gone - t_kill < 5.0, t_gone - t_kill
        text = err_path.read_text()
        assert len(text.splitlines()) < 30, text[-3000:]  # quiet: no C++ stacks
        # each worker's log says why it stopped, unless the parent-death SIGKILL came first
        logs = [p.read_text() for p in (run_dir / "logs").glob("rank*.log")]
        assert len(logs) == 2 and "Traceback" not in "".join(logs)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_lock_whose_launcher_died_is_held_by_its_live_workers(tmp_path):
    """The lock names the launcher and every local worker; stale only when none lives."""
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "run.lock").write_text(json.dumps(
            {"host": socket.gethostname(), "pid": dead.pid, "workers": [worker.pid]}))
        with pytest.raises(ConfigError, match=f"pids {worker.pid}.*launcher that is gone"):
            RunLock(tmp_path).acquire()
    finally:
        worker.kill()
        worker.wait()
    lines = []
    with RunLock(tmp_path, log=lines.append):
        pass
    assert "stale lock" in lines[0]
