"""A run on one host: its stores listen on loopback only, and a record a stranger writes
into them (an abort, a stop request) does not stop it (issue 49, break 5).

The run is a real `launch` of two workers (the elastic launcher `peerflow train` uses);
while both wait at a barrier the test reads every listening socket of the launcher and
the workers from /proc (what `ss -ltnp` shows), tries each port from this machine's
outside address, and writes a forged abort record and stop request into the fault store
the way any store client can. Before the fix the stores listened on `*:PORT` and the
forged abort stopped the run within two seconds, printing the attacker's message.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from peerflow.distributed.failure import FailureRecord
from tests.helpers.procs import program_launch
from tests.helpers.sockets import is_loopback, listening, outside_address

pytestmark = pytest.mark.distributed

PROGRAM = textwrap.dedent('''
    import json, os, time
    import torch, torch.distributed as dist
    from peerflow.distributed import dist_context, stage

    def run(config_path, overrides, run_dir, resume):
        ctx = dist_context()
        with stage("barrier"):
            t = torch.ones(1)
            dist.all_reduce(t)
        with open(os.path.join(run_dir, f"rank{ctx.rank}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "fault_store": os.environ["PEERFLOW_FAULT_STORE"]}, f)
        go = os.path.join(run_dir, "go")
        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            with stage("waiting for the test"):
                time.sleep(0.1)
        with stage("after"):
            dist.all_reduce(t)
        open(os.path.join(run_dir, f"done{ctx.rank}"), "w").close()
''')

LAUNCHER = textwrap.dedent('''
    import sys
    from peerflow.errors import PeerFlowError
    from peerflow.launch import launch
    try:
        launch(None, [], sys.argv[1], None, nprocs=2, fault_timeout=10.0,
               entry="storeprog:run", torch_threads=1)
    except PeerFlowError as exc:
        print("LAUNCHER:", exc, file=sys.stderr)
        sys.exit(1)
''')


def _wait_for(path, proc, seconds=120.0) -> dict:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} not written within {seconds:g} s"
        time.sleep(0.1)
    time.sleep(0.1)
    return json.loads(path.read_text())


def test_a_run_listens_on_loopback_only_and_ignores_forged_orders(tmp_path) -> None:
    run_dir, env = program_launch(tmp_path, "storeprog", PROGRAM)
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = [_wait_for(run_dir / f"rank{r}.json", proc) for r in range(2)]
        sockets = {pid: listening(pid) for pid in [proc.pid] + [r["pid"] for r in ranks]}
        print("listening:", sockets)
        assert sockets[proc.pid], "the launcher listens on nothing: the test reads no sockets"
        outside = [(pid, a) for pid, found in sockets.items() for a in found
                   if not is_loopback(a[0])]
        assert not outside, f"listening outside loopback: {outside}"
        address = outside_address()
        for port in {port for found in sockets.values() for _, port in found}:
            if address is not None:
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((address, port), timeout=2).close()
        host, _, port = ranks[0]["fault_store"].rpartition(":")
        stranger = dist.TCPStore(host, int(port), is_master=False)  # no secret
        forged = FailureRecord(rank=1, host="h1", stage="step 3", reporter=1,
                               reason="a stranger's message")
        stranger.set("peerflow/faults/abort", forged.to_json())
        stranger.set("peerflow/faults/stop/request", "a stranger says stop")
        time.sleep(3.0)  # six monitor polls (fault_timeout / 20); before: stopped in 1.8 s
        assert proc.poll() is None, proc.communicate()
        (run_dir / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "a stranger's message" not in err.split("refused the record")[0], err
    assert "refused the record under 'peerflow/faults/abort'" in err, err
    refused = {line.split("under ")[1].split(" in ")[0] for line in err.splitlines()
               if "refused the record under" in line}
    assert refused <= {"'peerflow/faults/abort'", "'peerflow/faults/stop/request'"}, err
    assert all((run_dir / f"done{r}").exists() for r in range(2)), err
