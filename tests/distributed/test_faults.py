"""A worker dies or raises mid-step: every other rank exits within `fault_timeout`,
naming the failed rank, host and stage, and the launcher exits non-zero."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from peerflow.distributed.failure import read_failure
from peerflow.distributed.faults import PEER_FAILED_EXIT, FaultMonitor

pytestmark = pytest.mark.distributed

PROGRAM = textwrap.dedent('''
    import os, signal, threading, time
    import torch, torch.distributed as dist
    from peerflow.distributed import stage

    def alive(path):
        while True:  # the last timestamp written is (about) when this process ended
            with open(path + ".tmp", "w") as f:
                f.write(str(time.time()))
            os.replace(path + ".tmp", path)
            time.sleep(0.05)

    def run(config_path, overrides, run_dir, resume):
        mode, victim = os.environ["FAULT_MODE"], int(os.environ["FAULT_RANK"])
        rank = dist.get_rank()
        threading.Thread(target=alive, args=(os.path.join(run_dir, f"alive{rank}"),),
                         daemon=True).start()
        for step in range(100000):
            with stage(f"step{step}/generate"):
                t = torch.ones(1)
                dist.all_reduce(t)
                if step == 3 and rank == victim and mode != "ok":
                    with open(os.path.join(run_dir, "t_fail"), "w") as f:
                        f.write(str(time.time()))
                    if mode == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise ValueError("reward function exploded")
                time.sleep(0.02)
            if mode == "ok" and step == 5:
                with open(os.path.join(run_dir, f"done{rank}"), "w") as f:
                    f.write("ok")
                return
''')

LAUNCHER = textwrap.dedent('''
    import sys
    from peerflow.errors import PeerFlowError
    from peerflow.launch import launch
    try:
        launch(None, [], sys.argv[1], None, nprocs=int(sys.argv[2]), launcher=sys.argv[3],
               fault_timeout=float(sys.argv[4]), entry="faultprog:run", torch_threads=1)
    except PeerFlowError as exc:
        print("LAUNCHER:", exc, file=sys.stderr)
        sys.exit(1)
''')


def run_launcher(tmp_path, mode: str, nprocs: int = 3, launcher: str = "elastic",
                 fault_timeout: float = 10.0, victim: int = 1):
    (tmp_path / "faultprog.py").write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               FAULT_MODE=mode, FAULT_RANK=str(victim), GLOO_SOCKET_IFNAME="lo",
               RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PEERFLOW_FAULT_STORE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path), str(nprocs), launcher,
                           str(fault_timeout)], env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, time.time()


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_dead_or_raising_worker_stops_everyone(tmp_path, mode) -> None:
    fault_timeout = 10.0
    proc, t_end = run_launcher(tmp_path, mode, nprocs=3, fault_timeout=fault_timeout)
    err = proc.stderr
    assert proc.returncode != 0, err
    host = socket.gethostname()
    named = f"rank 1 (host {host}) failed in stage 'step3/generate'"
    assert f"LAUNCHER: {named}" in err, err
    for survivor in (0, 2):
        assert f"peerflow: {named}" in err and f"; rank {survivor} (host {host}" in err, err
    if mode == "raise":  # one line on the console, the whole traceback in the rank's log
        assert "ValueError: reward function exploded" in err
        log = tmp_path / "logs" / "rank1.log"
        assert f"  full traceback: {log}" in err
        text = log.read_text()
        assert "Traceback (most recent call last)" in text and "faultprog.py" in text
        assert text.rstrip().endswith("ValueError: reward function exploded")
    else:
        assert "exited without finishing" in err or "no heartbeat" in err
    t_fail = float((tmp_path / "t_fail").read_text())
    for survivor in (0, 2):  # every other rank exited within fault_timeout of the failure
        t_exit = float((tmp_path / f"alive{survivor}").read_text())
        assert t_exit - t_fail < fault_timeout, (survivor, t_exit - t_fail, err)
    # and the launcher returned soon after (no hang; slack for interpreter shutdown)
    assert t_end - t_fail < fault_timeout + 30, (t_end - t_fail, err)


def test_clean_run_exits_zero(tmp_path) -> None:
    proc, _ = run_launcher(tmp_path, "ok", nprocs=2)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in tmp_path.glob("done*")} == {"done0", "done1"}


def test_heartbeat_watchers_detect_a_silent_rank() -> None:
    """Without a launcher (torchrun on many nodes), the ring of heartbeats finds a dead rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: dict[int, int] = {}
    lock = threading.Lock()

    def recorder(rank: int):
        def exit_process(code: int) -> None:
            with lock:
                exits[rank] = code
        return exit_process

    monitors = [FaultMonitor(store=store, rank=r, world_size=4, fault_timeout=2.0,
                             exit_process=recorder(r)).start() for r in range(4)]
    monitors[2].set_stage("values")
    time.sleep(0.5)
    start = time.monotonic()
    monitors[2]._stop.set()  # rank 2 goes silent (no 'done' marker): it died
    while len(exits) < 3 and time.monotonic() - start < 10:
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    for m in monitors:
        m.close()
    record = read_failure(store)
    assert record is not None and record.rank == 2 and record.stage == "values"
    assert "no heartbeat" in record.reason
    assert exits == {0: PEER_FAILED_EXIT, 1: PEER_FAILED_EXIT, 3: PEER_FAILED_EXIT}
    assert elapsed < 2.0  # within fault_timeout


def test_clean_finish_is_not_a_failure() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    monitors = [FaultMonitor(store=store, rank=r, world_size=2, fault_timeout=1.0,
                             exit_process=exits.append).start() for r in range(2)]
    time.sleep(0.2)
    monitors[1].close()
    time.sleep(1.5)
    monitors[0].close()
    assert exits == [] and read_failure(store) is None


def _silent_peer(rank: int, port: int, out) -> None:
    import torch

    from peerflow.distributed import init_distributed, wait_all
    from peerflow.errors import WorkerFailedError

    init_distributed("gloo", timeout=30, rank=rank, world_size=2,
                     init_method=f"tcp://127.0.0.1:{port}", monitor=False)
    if rank == 0:
        start = time.monotonic()
        try:
            wait_all([dist.irecv(torch.zeros(1), src=1)], "receiving advantages", timeout=1.5)
            out.put(("no error", 0.0))
        except WorkerFailedError as exc:
            out.put((str(exc), time.monotonic() - start))
        out.close()
        out.join_thread()  # flush the queue before leaving without teardown
    else:
        time.sleep(4)
    os._exit(0)  # rank 1 never sends; skip the collective teardown


def test_point_to_point_waits_time_out_with_a_message() -> None:
    from peerflow.launch.warm import warm_context
    from tests.helpers.gloo import free_port, warm_processes

    out = warm_context().Queue()
    port = free_port()
    with warm_processes(_silent_peer, [(r, port, out) for r in range(2)]):
        message, waited = out.get(timeout=280)
    assert "receiving advantages did not complete within 1.5 s" in message
    assert waited < 10


def test_stage_reports_own_error_and_comm_errors_blame_the_peer() -> None:
    from peerflow.distributed.failure import FailureRecord, publish_failure
    from peerflow.distributed.fault_scope import handle_failure, set_monitor, stage

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    monitor = FaultMonitor(store=store, rank=0, world_size=2, fault_timeout=2.0,
                           exit_process=exits.append)
    set_monitor(monitor)
    try:
        with pytest.raises(ValueError), stage("reward"):
            raise ValueError("bad row 7")
    finally:
        set_monitor(None)
    record = read_failure(store)
    assert (record.rank, record.stage, record.reason) == (0, "reward", "ValueError: bad row 7")
    assert exits == []

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monitor = FaultMonitor(store=store, rank=0, world_size=2, fault_timeout=2.0,
                           exit_process=exits.append)
    publish_failure(store, FailureRecord(rank=1, host="h1", stage="generate", reason="killed",
                                         reporter=-1))
    handle_failure(RuntimeError("[gloo] Connection closed by peer"), monitor)
    assert exits == [PEER_FAILED_EXIT]
    assert read_failure(store).rank == 1  # the first record stays


def test_a_stage_past_its_deadline_fails_the_run_naming_rank_and_detail() -> None:
    """The main thread is stuck (a reward that never returns): the monitor thread fails
    the run naming this rank, the stage, what it worked on and where it is stuck."""
    from peerflow.distributed.fault_scope import describe_stage, set_monitor, stage
    from peerflow.distributed.faults import STUCK_EXIT

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    monitor = FaultMonitor(store=store, rank=1, world_size=2, fault_timeout=2.0,
                           exit_process=exits.append).start()
    set_monitor(monitor)
    try:
        with stage("step 4 reward", deadline=0.3):
            describe_stage("reward 'hang' on sample_id 7")
            deadline = time.monotonic() + 10
            while not exits and time.monotonic() < deadline:
                time.sleep(0.05)  # "stuck": the monitor must act on its own
    finally:
        set_monitor(None)
        monitor.close()
    record = read_failure(store)
    assert exits == [STUCK_EXIT]
    assert record.rank == 1 and record.stage == "step 4 reward (reward 'hang' on sample_id 7)"
    assert "past the stage's deadline of 0.3 s" in record.reason
    assert "test_faults.py" in record.reason  # where the main thread was


def test_a_rank_that_timed_out_waiting_names_the_stuck_peer() -> None:
    """Rank 1 is stuck in its reward (heartbeats go on, no deadline fired yet); rank 0's
    collective times out: the failure names rank 1 and its stage, not rank 0."""
    from peerflow.distributed.fault_scope import handle_failure

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    monitors = [FaultMonitor(store=store, rank=r, world_size=3, fault_timeout=1.0,
                             exit_process=exits.append).start() for r in range(3)]
    monitors[1].set_stage("step 2 reward", detail="reward 'slow' on sample_id 3")
    time.sleep(0.05)
    monitors[2].set_stage("step 2 advantage")
    monitors[0].set_stage("step 2 advantage")
    handle_failure(RuntimeError("[gloo] Timed out waiting 1000ms for recv operation"),
                   monitors[0])  # rank 2 times out the same way, a little later
    for m in monitors:
        m.close()
    record = read_failure(store)
    assert record.rank == 1, record
    assert record.stage == "step 2 reward (reward 'slow' on sample_id 3)"
    assert "rank 0 timed out waiting for it in stage 'step 2 advantage'" in record.reason


def _run_hanging_reward(tmp_path, config: str, hang_rank: int, *extra: str,
                        **env_extra: str) -> subprocess.CompletedProcess:
    """Launches `config` on 2 processes with a reward that never returns on `hang_rank`
    (or, with `STUCK_SECONDS`, returns that much later)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", STUCK_RANK=str(hang_rank),
               **env_extra)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PEERFLOW_FAULT_STORE"):
        env.pop(key, None)
    overrides = ["run.steps=3", "run.prompts_per_step=4", "rollout.sampling.n=4",
                 "task.reward=stuck", "runtime.reward_timeout=2",
                 "runtime.fault_timeout=60", "run.trace=false", "run.tensorboard=false", *extra]
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.stuck_reward",
         os.path.join(root, "examples", config), str(tmp_path / "run"), *overrides],
        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("config", "hang_rank", "stage"), [
    ("quickstart.yaml", 1, "step 1 reward"),
    ("async.yaml", 0, "reward (async)"),
])
def test_a_reward_that_never_returns_fails_the_run_naming_rank_reward_and_sample(
        tmp_path, config: str, hang_rank: int, stage: str) -> None:
    """Rank `hang_rank`'s reward hangs (sync: the real step loop; async: every node of the
    streaming schedules runs as a stage with its deadline); the run fails after
    `runtime.reward_timeout`, naming that rank (not a waiting healthy one), the reward
    stage, the reward, its samples and the line it is stuck on."""
    proc = _run_hanging_reward(tmp_path, config, hang_rank=hang_rank)
    err = proc.stderr
    assert proc.returncode == 1, err
    host = socket.gethostname()
    launcher = next(line for line in err.splitlines() if line.startswith("LAUNCHER:"))
    assert (f"rank {hang_rank} (host {host}) failed in stage \"{stage} (reward "
            "'stuck' on sample_id ") in launcher, err
    assert "past the stage's deadline of 2 s" in launcher
    assert "stuck_reward.py:" in launcher and "in score" in launcher
    if config == "quickstart.yaml":
        assert "first: dataset row" in launcher
        assert f"; rank 0 (host {host}" in err  # the healthy rank exits naming rank 1


def test_a_live_peer_busy_longer_than_fault_timeout_is_waited_for(tmp_path) -> None:
    """Rank 1's reward takes 12 s, more than twice `fault_timeout` (5 s), while rank 0 waits
    for it in the step's routes and collectives: a live, busy peer is no fault — the run
    finishes (waits are bounded by `runtime.peer_wait_timeout`, not `fault_timeout`)."""
    proc = _run_hanging_reward(tmp_path, "quickstart.yaml", 1, "run.steps=2",
                               "runtime.reward_timeout=60", "runtime.fault_timeout=5",
                               STUCK_SECONDS="12", STUCK_FLAG=str(tmp_path / "slow"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "slow").exists() and (tmp_path / "slow.rank0").exists()
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
