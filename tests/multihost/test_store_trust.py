"""A stranger on the network cannot stop a multi-host run through its stores (issue 49).

Three network namespaces: h0 and h1 run the quickstart under `torchrun --nnodes 2` with
the run's secret; h2, a machine on the same network without it, connects to torchrun's
agent store on h0 (which torchrun lets anyone reach), reads the generation's prefix
and writes an abort record there, as the attack in the issue did. The run must go on to
its last step, both agents exit 0, and a rank logs the record as refused.
"""

from __future__ import annotations

import json
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

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
STEPS = 40

_REASON = unavailable()
pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(_REASON is not None, reason=f"multi-host tests: {_REASON}")]

ATTACKER = textwrap.dedent('''
    import datetime, sys
    import torch.distributed as dist
    host, record = sys.argv[1], sys.argv[2]
    agent = dist.TCPStore(host, 29400, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    nonce = agent.get(sys.argv[3]).decode().rsplit(":", 1)[1]
    for key in (f"peerflow/generation/{nonce}/peerflow/faults/abort", "peerflow/faults/abort"):
        agent.set(key, record)
    print("WROTE", nonce, flush=True)
''')


@pytest.fixture
def three_hosts() -> Iterator[Hosts]:
    """Two hosts of the run and a third, the stranger's, on one network."""
    made = Hosts.create(3)
    yield made
    made.destroy()


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] \
        if path.is_file() else []


@pytest.mark.slow
def test_a_stranger_cannot_abort_a_multi_host_run(three_hosts, tmp_path) -> None:
    """Slow (a two-host run, ~40 s); the default run keeps the contract with
    tests/distributed/test_run_stores.py (one host) and tests/unit/test_store_trust.py
    (the signature checks)."""
    hosts, run = three_hosts, tmp_path / "run"
    procs = []
    for i in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts.address(0)}:29400", "--rdzv-id", hosts.tag,
                "--local-addr", hosts.address(i), "-m", "peerflow", "train", QUICKSTART,
                "--run-dir", str(run), "--set", "run.trace=false",
                "--set", f"run.steps={STEPS}", "--set", "runtime.fault_timeout=10"]
        procs.append(hosts.popen(i, argv, env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + 240
    while not _steps(run):
        assert time.monotonic() < deadline, "no step within 240 s"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    forged = FailureRecord(rank=1, host="h1", stage="step 3", reporter=1,
                           reason="a stranger's message")
    stranger = {k: v for k, v in env().items() if k != "PEERFLOW_RUN_SECRET"}
    attack = hosts.popen(2, [sys.executable, "-c", ATTACKER, hosts.address(0),
                             forged.to_json(), ADDRESS_KEY], stranger,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = attack.communicate(timeout=120)[0]
    assert attack.returncode == 0 and "WROTE" in said, said
    time.sleep(3.0)  # six monitor polls: the old code stopped the run within two seconds
    assert all(p.poll() is None for p in procs), "the run ended before the check"
    assert _steps(run)[-1] < STEPS, "the run finished before it could see the record"
    results = [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    output = results[0][1] + results[1][1]
    assert [code for code, _ in results] == [0, 0], results
    assert "refused the record under 'peerflow/faults/abort'" in output, output
    assert "failed in stage 'step 3': a stranger's message" not in output, output
    assert _steps(run)[-1] == STEPS
