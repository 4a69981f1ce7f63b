"""A run's stores take no orders from strangers (issue 49, break 5): what a writer without
the run's secret puts in a store is refused, the records a rank's pid comes from are
checked, and a job across hosts without a secret is refused naming the fix.

The stores are real `torch.distributed` stores (`HashStore`, and a `TCPStore` for the
listening address); the attacker writes to them directly, as a store client would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from peerflow.coordinator.transport import host_identity, read_host_records
from peerflow.distributed.failure import FailureRecord, publish_failure, read_failure
from peerflow.distributed.faults import FaultMonitor
from peerflow.distributed.init import (
    SOCKET_IFNAME_ENVS,
    check_run_secret,
    fault_store,
    keep_sockets_on_loopback,
)
from peerflow.distributed.listen import listening_store
from peerflow.distributed.signing import (
    RUN_SECRET_ENV,
    RUN_SECRET_FILE_ENV,
    RecordRefusedError,
    SignedStore,
    run_secret,
)
from peerflow.distributed.stop import request_stop, stop_reason
from peerflow.errors import ConfigError
from peerflow.launch.watch import FaultStore
from tests.helpers.sockets import outside_address

SECRET = b"0123456789abcdef0123456789abcdef"
FORGED = FailureRecord(rank=1, host="h1", stage="step 3", reason="attacker's message",
                       reporter=1)


def _store(secret: bytes | None = SECRET, scope: str = "") -> tuple[SignedStore, dist.Store]:
    raw = dist.HashStore()
    return SignedStore(raw=raw, secret=secret, scope=scope), raw


def test_a_forged_abort_record_is_refused_and_logged(capsys) -> None:
    store, raw = _store()
    raw.set("peerflow/faults/abort", FORGED.to_json())  # a client without the secret
    assert read_failure(store) is None
    assert read_failure(store) is None  # logged once
    err = capsys.readouterr().err
    assert err.count("refused the record under 'peerflow/faults/abort'") == 1, err
    assert "attacker" in err


def test_a_monitor_does_not_exit_on_a_forged_abort() -> None:
    store, raw = _store()
    exits = []
    monitor = FaultMonitor(store=store, rank=0, world_size=1, exit_process=exits.append)
    raw.set("peerflow/faults/abort", FORGED.to_json())
    assert monitor._tick(0.0) is None
    assert exits == []


def test_the_runs_own_failure_replaces_a_forged_one() -> None:
    store, raw = _store()
    raw.set("peerflow/faults/abort", FORGED.to_json())
    mine = FailureRecord(rank=0, host="h0", stage="reward", reason="real", reporter=0)
    assert publish_failure(store, mine) == mine
    assert read_failure(store) == mine
    later = FailureRecord(rank=1, host="h1", stage="x", reason="second", reporter=1)
    assert publish_failure(store, later) == mine  # the first valid record still wins


def test_a_forged_stop_request_is_ignored() -> None:
    store, raw = _store()
    raw.set("peerflow/faults/stop/request", "attacker says stop")
    assert stop_reason(store) is None
    request_stop(store, "SIGINT")
    assert stop_reason(store) == "SIGINT"


def test_a_signed_value_moved_to_another_key_or_scope_is_refused() -> None:
    store, raw = _store(scope="gen-a")
    store.set("peerflow/faults/done/0", "1")
    raw.set("peerflow/faults/done/1", raw.get("peerflow/faults/done/0"))
    assert store.check(["peerflow/faults/done/0"])
    assert not store.check(["peerflow/faults/done/1"])
    other = SignedStore(raw=raw, secret=SECRET, scope="gen-b")
    assert not other.check(["peerflow/faults/done/0"])
    wrong_key = SignedStore(raw=raw, secret=b"another-secret-of-32-characters!")
    assert not wrong_key.check(["peerflow/faults/done/0"])


def test_without_a_secret_records_pass_unsigned() -> None:
    store, raw = _store(secret=None)
    store.set("k", "v")
    assert raw.get("k") == b"v" and store.get("k") == b"v"


def _record(pid: int, identity: str | None = None) -> str:
    return f"{host_identity() if identity is None else identity}|{pid}|4"


def _live_pid() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])


@pytest.mark.parametrize("forged", ["999999999", "garbage", "0", "1", "own"])
def test_a_forged_host_record_is_refused_with_a_clear_error(forged) -> None:
    if not host_identity():
        pytest.skip("no writable /dev/shm: the shared-memory transport is not used")
    store, raw = _store(secret=None)  # unsigned: the pid itself is checked
    store.set("peerflow/host/0", _record(os.getpid()))
    value = {"garbage": "rm -rf /|x|y", "own": _record(os.getpid())}.get(forged)
    raw.set("peerflow/host/1", value or _record(int(forged)))
    with pytest.raises(RecordRefusedError, match=r"rank 1|ranks \[0, 1\]") as info:
        read_host_records(store, [0, 1], world_size=2)
    assert "outside the run" in str(info.value) or "not a live process" in str(info.value)


def test_host_records_of_live_ranks_are_read() -> None:
    store, _ = _store()
    peer = _live_pid()
    try:
        store.set("peerflow/host/0", _record(os.getpid()))
        store.set("peerflow/host/1", _record(peer.pid))
        hosts, pids, cores = read_host_records(store, [0, 1], world_size=2)
    finally:
        peer.kill()
        peer.wait()
    assert pids == {0: os.getpid(), 1: peer.pid} and cores == [4, 4]
    assert list(hosts.values()) == [[0, 1]]


def test_an_unsigned_host_record_is_refused_when_the_run_has_a_secret() -> None:
    store, raw = _store()
    store.set("peerflow/host/0", _record(os.getpid()))
    raw.set("peerflow/host/1", _record(os.getpid()))
    with pytest.raises(RecordRefusedError, match="not signed with the run's secret"):
        read_host_records(store, [0, 1], world_size=2)


def test_a_rank_outside_the_world_is_refused() -> None:
    store, _ = _store()
    store.set("peerflow/host/5", _record(os.getpid()))
    with pytest.raises(RecordRefusedError, match="outside the world of 2"):
        read_host_records(store, [5], world_size=2)


def test_a_job_across_hosts_without_a_secret_is_refused(monkeypatch) -> None:
    for name in (RUN_SECRET_ENV, RUN_SECRET_FILE_ENV, "PEERFLOW_FAULT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.1.0.1")
    with pytest.raises(ConfigError, match=f"{RUN_SECRET_ENV}.*{RUN_SECRET_FILE_ENV}"):
        check_run_secret()
    monkeypatch.setenv(RUN_SECRET_ENV, SECRET.decode())
    check_run_secret()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one host: no secret needed
    monkeypatch.delenv(RUN_SECRET_ENV)
    check_run_secret()


def test_a_secret_file_others_can_read_is_refused(monkeypatch, tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET.decode() + "\n")
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    monkeypatch.setenv(RUN_SECRET_FILE_ENV, str(path))
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {path}"):
        run_secret()
    path.chmod(0o600)
    assert run_secret() == SECRET
    path.write_text("short")
    with pytest.raises(ConfigError, match="fewer than 16"):
        run_secret()


def test_a_listening_store_answers_on_its_address_only() -> None:
    store = listening_store("127.0.0.1")
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    outside = outside_address()
    if outside is None:
        pytest.skip("this machine has no address outside loopback")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((outside, store.port), timeout=2).close()


def test_a_signed_abort_from_an_earlier_run_with_the_same_secret_is_refused(monkeypatch) -> None:
    """A secret kept across runs (the documented `~/.peerflow-secret`): anyone who can read
    one run's launcher store (stores have no read access control) copies its signed abort
    record into the next run's store; the MAC must bind the record to the run."""
    monkeypatch.setenv(RUN_SECRET_ENV, SECRET.decode())
    earlier, later = FaultStore(world_size=2), FaultStore(world_size=2)
    try:
        mine = FailureRecord(rank=1, host="h1", stage="step 9", reason="earlier run's", reporter=1)
        publish_failure(earlier.store, mine)
        copied = earlier.raw.get("peerflow/faults/abort")  # what a store reader sees
        later.raw.set("peerflow/faults/abort", copied)  # a client without the secret
        assert later.failure() is None
        for name, value in later.environment.items():  # what the workers are given
            monkeypatch.setenv(name, value)
        worker = fault_store(None, timeout=5.0)
        assert read_failure(worker) is None
        publish_failure(worker, FORGED)  # the run's own record still reaches the launcher
        assert later.failure() == FORGED
    finally:
        earlier.stop()
        later.stop()


def test_on_one_machine_nccl_listens_on_loopback_too(monkeypatch) -> None:
    """NCCL's bootstrap skips `lo` unless told, so a one-host GPU run listened on the
    machine's network interface for its whole life (gloo was already kept on `lo`)."""
    for name in SOCKET_IFNAME_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.2")  # any loopback address
    keep_sockets_on_loopback()
    assert {os.environ[name] for name in SOCKET_IFNAME_ENVS} == {"lo"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the operator's choice is kept
    keep_sockets_on_loopback()
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # across hosts: the interface is theirs
    keep_sockets_on_loopback()
    assert "NCCL_SOCKET_IFNAME" not in os.environ


def test_a_flood_of_distinct_forgeries_is_logged_a_bounded_number_of_times(capsys) -> None:
    """Each distinct forged value was logged and kept (whole) forever: a writer changing
    its value at every poll grew the rank's memory and log without bound."""
    store, raw = _store()
    for i in range(200):
        raw.set("peerflow/faults/abort", f"{i}:" + "x" * 100_000)
        assert read_failure(store) is None
    err = capsys.readouterr().err
    assert err.count("refused the record under 'peerflow/faults/abort'") <= 17, err[:300]
    assert "further refusals" in err
    assert len(store._refused) <= 32  # noqa: SLF001 — what the store keeps


def test_a_secret_file_another_account_owns_is_refused(monkeypatch, tmp_path) -> None:
    """Mode 0600 proves only that its owner can read it: a file another account made (in
    /tmp, say) is a secret that account knows."""
    path = tmp_path / "secret"
    path.write_text(SECRET.decode())
    path.chmod(0o600)
    other = os.geteuid() + 1 if os.geteuid() != 0 else 65534
    try:
        os.chown(path, other, -1)
    except PermissionError:
        pytest.skip("cannot give a file to another account here (not root)")
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    monkeypatch.setenv(RUN_SECRET_FILE_ENV, str(path))
    with pytest.raises(ConfigError, match=f"owned by uid {other}"):
        run_secret()


def test_a_generation_address_from_another_torchrun_job_is_refused(monkeypatch) -> None:
    """The address (and nonce) records a generation's rank 0 publishes were signed under
    no scope: with a secret kept across jobs, one job's records, copied into the next
    job's agent store, pointed its ranks at the earlier job's store."""
    from peerflow.distributed.round_store import ADDRESS_KEY, generation_stores

    monkeypatch.setenv(RUN_SECRET_ENV, SECRET.decode())
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    earlier = listening_store("127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(earlier.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    own, _ = generation_stores(0, timeout=5.0)  # job a's rank 0 publishes its store
    later = listening_store("127.0.0.1")
    later.set(ADDRESS_KEY, earlier.get(ADDRESS_KEY))  # a store reader copies the record
    monkeypatch.setenv("MASTER_PORT", str(later.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    with pytest.raises(TimeoutError, match="published no reachable store"):
        generation_stores(1, timeout=1.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")  # the same job's rank connects
    monkeypatch.setenv("MASTER_PORT", str(earlier.port))
    assert generation_stores(1, timeout=5.0)[0].port == own.port
