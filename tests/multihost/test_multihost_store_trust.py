"""A stranger on the network cannot stop a multi-host run through its stores (issue 49).

Three network namespaces: h0 and h1 run a two-rank job under `torchrun --nnodes 2` with
the run's secret (PeerFlow's worker entry, the fault monitor and the generation stores
of `peerflow train`, around a loop of all-reduces); h2, a machine on the same network
without the secret, connects to torchrun's agent store on h0 (torchrun's, listening on
every interface; its port is found as a port scan would, here from the worker's
environment), reads the generation's prefix and writes an abort record there and at the
plain key, as the attack in the issue did. The run must go on until the test lets it finish,
both agents exit 0, and the ranks log the record as refused. Before the fix the record
stopped a run within two seconds, printing the stranger's message as a rank's failure.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Hosts, unavailable
from sync_bench import env

from peerflow.distributed.failure import FailureRecord
from peerflow.distributed.round_store import ADDRESS_KEY

_REASON = unavailable()
pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(_REASON is not None, reason=f"multi-host tests: {_REASON}")]

PROGRAM = textwrap.dedent('''
    import os, time
    import torch, torch.distributed as dist
    from peerflow.distributed import stage

    def run(config_path, overrides, run_dir, resume):
        rank, step = dist.get_rank(), 0
        while True:
            with stage(f"step {step}"):
                flag = torch.tensor([float(os.path.exists(os.path.join(run_dir, "go")))])
                dist.all_reduce(flag)  # every rank stops at the same step
            if flag.item() > 0:
                break
            if step == 0:
                open(os.path.join(run_dir, f"started{rank}"), "w").close()
            step += 1
            time.sleep(0.05)
        open(os.path.join(run_dir, f"done{rank}"), "w").close()
''')

SCRIPT = textwrap.dedent('''
    import sys
    from peerflow.launch import launch
    launch(None, [], sys.argv[1], None, nprocs=1, fault_timeout=10.0,
           entry="trustprog:run", torch_threads=1)
''')

ATTACKER = textwrap.dedent('''
    import datetime, sys
    import torch.distributed as dist
    host, port, record, key = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    agent = dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    nonce = agent.get(key).decode().rsplit(":", 1)[1]
    prefix = f"peerflow/generation/{nonce}//"  # dist.PrefixStore joins with "/"
    assert agent.check([prefix + "peerflow/faults/hb/0"]), "not the ranks' fault keys"
    for key in (prefix + "peerflow/faults/abort", "peerflow/faults/abort"):
        agent.set(key, record)
    print("WROTE", nonce, flush=True)
''')


@pytest.fixture
def three_hosts() -> Iterator[Hosts]:
    """Two hosts of the run and a third, the stranger's, on one network."""
    made = Hosts.create(3)
    yield made
    made.destroy()


def _wait_started(run_dir, procs) -> None:
    deadline = time.monotonic() + 180
    while not all((run_dir / f"started{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "the ranks did not start within 180 s"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)


def _agent_store_port(hosts: Hosts) -> str:
    """The port of torchrun's agent store on h0 (`MASTER_PORT` of its worker)."""
    for pid in hosts.pids(0):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"RANK" in values and b"MASTER_PORT" in values:
            return values[b"MASTER_PORT"].decode()
    raise AssertionError("no worker with MASTER_PORT on h0")


@pytest.mark.slow
def test_a_stranger_cannot_abort_a_multi_host_run(three_hosts, tmp_path) -> None:
    """Slow (two hosts' torchrun start-up, ~20 s); in the default run
    tests/distributed/test_run_stores.py keeps the contract on one host (a forged abort
    written by a store client without the secret is refused, the run finishes) and
    tests/unit/test_store_trust.py the signature checks this relies on."""
    hosts, run = three_hosts, tmp_path / "run"
    run.mkdir()
    (tmp_path / "trustprog.py").write_text(PROGRAM)
    (tmp_path / "trust_script.py").write_text(SCRIPT)
    host_env = dict(env(), PYTHONPATH=f"{tmp_path}:{env()['PYTHONPATH']}")
    procs = []
    for i in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts.address(0)}:29400", "--rdzv-id", hosts.tag,
                "--local-addr", hosts.address(i), str(tmp_path / "trust_script.py"), str(run)]
        procs.append(hosts.popen(i, argv, host_env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
    try:
        _wait_started(run, procs)
        forged = FailureRecord(rank=1, host="h1", stage="step 3", reporter=1,
                               reason="a stranger's message")
        stranger = {k: v for k, v in host_env.items() if k != "PEERFLOW_RUN_SECRET"}
        attack = hosts.popen(2, [sys.executable, "-c", ATTACKER, hosts.address(0),
                                 _agent_store_port(hosts), forged.to_json(), ADDRESS_KEY],
                             stranger,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = attack.communicate(timeout=120)[0]
        assert attack.returncode == 0 and "WROTE" in said, said
        time.sleep(3.0)  # six monitor polls (fault_timeout / 20)
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        (run / "go").touch()
        results = [(p.wait(timeout=120), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    output = results[0][1] + results[1][1]
    assert [code for code, _ in results] == [0, 0], results
    assert "refused the record under 'peerflow/faults/abort'" in output, output
    assert "a stranger's message;" not in output, output
    assert all((run / f"done{r}").exists() for r in range(2))
