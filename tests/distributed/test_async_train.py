"""`runtime.mode: async` end to end on CPU: hf rollout ranks feed fsdp trainer ranks (and
the same split placement run in sync mode)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from tests.helpers.gloo import free_port, start_warm, stop_warm, warm_process

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
SMALL = [
    "run.prompts_per_step=4", "rollout.sampling.n=4", "run.tensorboard=false",
    "runtime.fault_timeout=60", "run.checkpoint_every=0",
]
SPLIT = ["runtime.placement=split", "rollout.layout.dp=1", "trainer.layout.dp=1"]
#: Metrics that measure time or the async machinery itself, not learning.
NOT_LEARNING = ("time/", "throughput/", "sync/", "idle/", "overlap/", "queue/", "staleness/",
                "rollout/", "memory/", "weight_sync/")


def _worker(rank, world, port, overrides, run_dir, resume):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    from peerflow.worker.main import run_worker

    run_worker(QUICKSTART, overrides, run_dir, resume=resume)


def run_workers(overrides, run_dir, world=2, resume=None, timeout=240):
    port = free_port()
    codes = stop_warm(start_warm(_worker, [(r, world, port, overrides, str(run_dir), resume)
                                           for r in range(world)]), timeout)
    assert None not in codes, "a worker hung"
    return codes


def run_single(overrides, run_dir):
    os.environ.pop("RANK", None)
    p = warm_process(_single, (overrides, str(run_dir)))
    p.start()
    p.join(240)
    assert not p.is_alive(), "worker hung"
    return p.exitcode


def _single(overrides, run_dir):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    os.environ.update(GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    from peerflow.worker.main import run_worker

    run_worker(QUICKSTART, overrides, run_dir)


def metrics(run_dir):
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_zero_staleness_matches_sync_and_bounds_hold(tmp_path):
    # a large learning rate makes later steps' samples depend on the pushed weights;
    # evaluation runs in both modes through the driver's EvalHook (async: the rollout rank
    # evaluates each due step's pushed weights), so its metrics match too
    steps = ["run.steps=3", "trainer.lr=0.05", "run.eval_every=2", "eval.max_prompts=4",
             "eval.n=2"]
    assert run_single([*SMALL, *steps, "runtime.nprocs=1"], tmp_path / "sync") == 0
    codes = run_workers([*SMALL, *steps, *SPLIT, "runtime.mode=async", "runtime.max_staleness=0"],
                        tmp_path / "async0")
    assert codes == [0, 0]
    sync, async0 = metrics(tmp_path / "sync"), metrics(tmp_path / "async0")
    assert [m["step"] for m in async0] == [0, 1, 2, 3]
    evaluated = [m["step"] for m in async0 if "eval/greedy/reward" in m]
    assert evaluated == [0, 2, 3] == [m["step"] for m in sync if "eval/greedy/reward" in m]
    assert all(m["eval/prompts"] == 4 and "eval/pass@2" in m for m in async0 if m["step"] in
               evaluated)
    assert (tmp_path / "async0" / "samples" / "eval_step_2.jsonl").is_file()
    compared = 0
    for s, a in zip(sync[1:], async0[1:]):
        assert a["staleness/max"] == 0 and a["samples"] == 16
        for key, value in s.items():
            if key in a and not key.startswith(NOT_LEARNING):
                assert math.isclose(a[key], value, rel_tol=1e-4, abs_tol=1e-6), (key, value, a[key])
                compared += 1
    assert compared >= 3 * 10
    for s, a in zip(sync, async0):  # the evaluations, the initial model's included
        for key in (k for k in s if k.startswith("eval/")):
            assert math.isclose(a[key], s[key], rel_tol=1e-4, abs_tol=1e-6), (key, s[key], a)
    assert {"reward/mean", "actor/loss", "actor/grad_norm"} <= set(async0[-1])
    # each reward's own mean: the rewards ran on the rollout rank, the trainer logs it
    per_reward = {k for k in async0[-1] if k.startswith("reward/") and k.endswith("/mean")}
    assert per_reward == {k for k in sync[-1] if k.startswith("reward/") and k.endswith("/mean")}
    assert len(per_reward) >= 2, per_reward


def test_async_run_respects_bound_loses_nothing_and_resumes(tmp_path):
    run_dir = tmp_path / "async"
    base = [*SMALL, *SPLIT, "runtime.mode=async", "runtime.max_staleness=1",
            "runtime.async_prompts_per_call=1", "run.checkpoint_every=2",
            "runtime.partial_rollout=true", "runtime.partial_rollout_tokens=2"]
    assert run_workers([*base, "run.steps=2"], run_dir) == [0, 0]
    first = metrics(run_dir)
    state2 = json.loads((run_dir / "checkpoints" / "step_000002" / "inflight.json").read_text())
    assert run_workers([*base, "run.steps=4"], run_dir, resume=str(run_dir)) == [0, 0]
    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert rows[:2] == first
    for row in rows:
        assert row["staleness/max"] <= 1 and row["samples"] == 16
        assert math.isclose(sum(v for k, v in row.items() if k.startswith("staleness/hist_")), 1.0)
        # decoupled PPO is on by default: its weights and the rollout/trainer mismatch
        assert row["off_policy/is_weight_max"] > 0
        assert 0 <= row["off_policy/truncated_fraction"] <= 1
        assert row["mismatch/kl"] >= 0.0 and row["mismatch/abs_max"] >= 0.0
    state4 = json.loads((run_dir / "checkpoints" / "step_000004" / "inflight.json").read_text())
    trained2 = [g for gids in state2["trained_groups"].values() for g in gids]
    trained4 = [g for gids in state4["trained_groups"].values() for g in gids]
    assert len(trained2) == len(set(trained2)) == 2 * 4
    assert len(trained4) == len(set(trained4)) == 4 * 4  # nothing trained twice
    assert set(trained2) <= set(trained4)
    # prompts in flight at the step-2 checkpoint were generated again after the resume
    holes = set(range(max(trained2) + 1)) - set(trained2)
    assert holes <= set(trained4)
    trace = json.loads((run_dir / "trace_rank0.json").read_text())
    assert any(e.get("name") == "rollout/generate" for e in trace["traceEvents"])


def test_async_ppo_with_a_critic_resumes_exactly(tmp_path):
    # max_staleness=0 makes the async schedule deterministic, so two runs can be compared
    base = [*SMALL, *SPLIT, "runtime.mode=async", "runtime.max_staleness=0",
            "workflow.graph=ppo", "algorithm.advantage=gae", "run.checkpoint_every=2",
            "trainer.lr=0.05"]
    assert run_workers([*base, "run.steps=4"], tmp_path / "full") == [0, 0]
    assert run_workers([*base, "run.steps=2"], tmp_path / "part") == [0, 0]
    saved = tmp_path / "part" / "checkpoints" / "step_000002"
    assert (saved / "critic").is_dir() and (saved / "actor").is_dir()
    assert run_workers([*base, "run.steps=4"], tmp_path / "part",
                       resume=str(tmp_path / "part")) == [0, 0]

    def learning(rows):
        return [{k: v for k, v in r.items() if not k.startswith(NOT_LEARNING)} for r in rows]

    full, resumed = learning(metrics(tmp_path / "full")), learning(metrics(tmp_path / "part"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert any(k.startswith("critic/") for k in resumed[3])
    assert resumed == full
    assert resumed[2] != resumed[0]


class _DieAtVersion2:
    """Kills the rollout rank right after it loads weight version 2 (no goodbye)."""

    from peerflow.plugins.hookspecs import hookimpl

    @hookimpl
    def peerflow_after_weight_sync(self, version, role, rank, stats):
        if role == "rollout" and version >= 2:
            os._exit(9)


def _dying_worker(rank, world, port, overrides, run_dir, log_dir):
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT)
    os.dup2(log, 2)
    if rank == 0:
        from peerflow.plugins import get_plugin_manager

        get_plugin_manager().register(_DieAtVersion2(), "test-die")
    _worker(rank, world, port, overrides, run_dir, None)


def test_dead_rollout_rank_fails_the_run_fast(tmp_path):
    overrides = [*SMALL, *SPLIT, "runtime.mode=async", "runtime.max_staleness=1",
                 "run.steps=6", "runtime.fault_timeout=20"]
    port = free_port()
    procs = [warm_process(_dying_worker, (r, 2, port, overrides, str(tmp_path / "run"),
                                          str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(240)
    died = time.time()
    procs[1].join(120)
    noticed = time.time()
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[0].exitcode == 9
    assert procs[1].exitcode not in (0, None), "the trainer kept running without its rollout"
    assert noticed - died < 60  # well within the fault timeout plus start-up noise
    trainer_log = (tmp_path / "rank1.log").read_text()
    assert "rank 0" in trainer_log, trainer_log[-2000:]


@pytest.mark.slow
def test_two_rollout_ranks_feed_one_trainer(tmp_path):
    overrides = [*SMALL, "runtime.placement=split", "rollout.layout.dp=2",
                 "trainer.layout.dp=1", "runtime.nprocs=3", "runtime.mode=async",
                 "runtime.max_staleness=2", "runtime.sampler=length_balanced", "run.steps=3",
                 "run.checkpoint_every=3"]
    assert run_workers(overrides, tmp_path / "run", world=3) == [0, 0, 0]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["samples"] == 16 and r["staleness/max"] <= 2 for r in rows)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000003" /
                        "inflight.json").read_text())
    per_source = {int(k): v for k, v in state["trained_groups"].items()}
    assert sorted(per_source) == [0, 1] and all(len(v) == 3 * 2 for v in per_source.values())
    assert all(g % 2 == src for src, gids in per_source.items() for g in gids)  # own shard


ONE_ROLLOUT_TWO_TRAINERS = [*SMALL, "runtime.placement=split", "rollout.layout.dp=1",
                            "trainer.layout.dp=2", "runtime.nprocs=3", "run.steps=2"]


def test_one_rollout_rank_feeds_two_trainer_ranks_that_share_prompts(tmp_path):
    """fsdp trainers share prompts by default: every rank learns it at start-up (a
    collective), and the rollout rank weighs the groups it streams by it."""
    overrides = [*ONE_ROLLOUT_TWO_TRAINERS, "runtime.mode=async"]
    assert run_workers(overrides, tmp_path / "run", world=3) == [0, 0, 0]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["samples"] == 16 for r in rows)
    for rank in (1, 2):  # each trainer trains half of every step (2 of its 4 groups)
        trace = json.loads((tmp_path / "run" / f"trace_rank{rank}.json").read_text())
        trained = [e["args"]["samples"] for e in trace["traceEvents"]
                   if e.get("name", "").startswith("trainer/train step")]
        assert trained == [8, 8], (rank, trained)


def test_in_sync_mode_a_route_between_roles_weighs_what_the_trainers_run(tmp_path):
    """A split sync run whose route from the rollout rank (hosting no trainer engine) to
    the two trainer ranks counts each prompt once, as the trainers run it, over gloo where
    the rollout rank plans the route too; the route reports its own CPU and bytes beside
    its wall. A smoke test: with one producer a plan that differs between ranks still
    runs, so the decision itself is checked in tests/unit/test_shared_prompt_balance.py."""
    ragged = ["task.options.min_digits=1", "task.options.digits=9",  # prompts 2–10 tokens
              "runtime.coordinator_transport=gloo"]  # where the producer plans too
    assert run_workers([*ONE_ROLLOUT_TWO_TRAINERS, *ragged], tmp_path / "run",
                       world=3) == [0, 0, 0]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["samples"] == 16 and r["balance/imbalance_after"] >= 1 for r in rows)
    for row in rows:  # what the route itself cost, beside its wall (which waits for rank 0)
        name = "rollout->actor@advantage"
        assert 0 < row[f"coordinator/{name}/cpu_s"] <= row[f"time/route_{name}"]
        assert row[f"coordinator/{name}/bytes"] > 0
