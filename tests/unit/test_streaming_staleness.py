"""Property tests of bounded-staleness admission and step assignment.

A discrete-event model of the async protocol drives real `StalenessScheduler`s: several
rollout ranks with random speeds and concurrency generate groups of random (long-tailed)
lengths, seal steps, and a trainer runs step `s` once every rank sealed it, then pushes
version `s + 1` to the rollout ranks after a random delay.
"""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerflow.errors import ConfigError
from peerflow.streaming.staleness import StalenessError, StalenessScheduler


def simulate(*, max_staleness, quotas, speeds, concurrency, lengths, train_time, push_delay, steps):
    """Runs the protocol until `steps` training steps are done.

    Returns a dict with every assignment per step, the admission log and the version each
    group was generated under.
    """
    ranks = len(quotas)
    scheds = [StalenessScheduler(max_staleness=max_staleness, quota=q) for q in quotas]
    version = [0] * ranks  # rollout weight version per rank
    trainer_version = 0
    trainer_busy_until = None
    events: list = []  # (time, seq, kind, payload)
    seq = itertools.count()
    lengths_iter = [itertools.cycle(lengths[r::ranks] or lengths) for r in range(ranks)]
    next_gid = itertools.count()
    admitted: dict[int, tuple[int, int]] = {}  # gid -> (rank, version)
    admit_order: list[list[int]] = [[] for _ in range(ranks)]
    steps_content: dict[int, list] = {}
    in_flight = [0] * ranks
    now = 0.0

    def admit_more(r):
        while in_flight[r] < concurrency[r] and scheds[r].can_admit(version[r], trainer_version):
            gid = next(next_gid)
            scheds[r].admit(gid, version[r], trainer_version)
            admitted[gid] = (r, version[r])
            admit_order[r].append(gid)
            in_flight[r] += 1
            heapq.heappush(
                events, (now + next(lengths_iter[r]) / speeds[r], next(seq), "done", (r, gid))
            )

    def try_train():
        nonlocal trainer_busy_until
        if (
            trainer_busy_until is None
            and trainer_version < steps
            and all(s.sealed_steps() > trainer_version for s in scheds)
        ):
            trainer_busy_until = now + train_time
            heapq.heappush(events, (trainer_busy_until, next(seq), "trained", trainer_version))

    for r in range(ranks):
        admit_more(r)
    guard = 0
    while trainer_version < steps:
        guard += 1
        assert guard < 100_000, "simulation did not terminate (deadlock)"
        assert events, (
            f"deadlock at trainer version {trainer_version}: sealed "
            f"{[s.sealed_steps() for s in scheds]}, rollout versions {version}"
        )
        now, _, kind, payload = heapq.heappop(events)
        if kind == "done":
            r, gid = payload
            in_flight[r] -= 1
            scheds[r].finish(gid)
            for a in scheds[r].assign_finished():
                steps_content.setdefault(a.step, []).append(a)
            admit_more(r)
            try_train()
        elif kind == "trained":
            assert payload == trainer_version
            trainer_version += 1
            trainer_busy_until = None
            for r in range(ranks):
                heapq.heappush(
                    events, (now + push_delay[r], next(seq), "weights", (r, trainer_version))
                )
            try_train()
        elif kind == "weights":
            r, v = payload
            version[r] = max(version[r], v)
            admit_more(r)
    return {"steps": steps_content, "admitted": admitted, "order": admit_order, "scheds": scheds}


lengths_st = st.lists(
    st.one_of(st.integers(1, 20), st.integers(100, 400)),  # long-tailed mix
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    max_staleness=st.integers(0, 3),
    ranks=st.integers(1, 3),
    data=st.data(),
    lengths=lengths_st,
    train_time=st.floats(0.1, 300.0),
    steps=st.integers(1, 8),
)
def test_staleness_never_exceeds_bound_and_nothing_lost(
    max_staleness, ranks, data, lengths, train_time, steps
):
    quotas = data.draw(st.lists(st.integers(1, 4), min_size=ranks, max_size=ranks))
    speeds = data.draw(st.lists(st.floats(0.5, 20.0), min_size=ranks, max_size=ranks))
    concurrency = data.draw(st.lists(st.integers(1, 8), min_size=ranks, max_size=ranks))
    push_delay = data.draw(st.lists(st.floats(0.0, 50.0), min_size=ranks, max_size=ranks))
    out = simulate(
        max_staleness=max_staleness,
        quotas=quotas,
        speeds=speeds,
        concurrency=concurrency,
        lengths=lengths,
        train_time=train_time,
        push_delay=push_delay,
        steps=steps,
    )
    seen: set[int] = set()
    for step in range(steps):
        content = out["steps"][step]
        # every step holds exactly each rank's quota
        per_rank = [sum(out["admitted"][a.group_id][0] == r for a in content) for r in range(ranks)]
        assert per_rank == quotas
        for a in content:
            assert a.step == step
            assert 0 <= a.staleness <= max_staleness
            assert a.version == out["admitted"][a.group_id][1]
            assert a.group_id not in seen, "group assigned twice"
            seen.add(a.group_id)
    # no admitted group is lost: it is assigned, still generating, or finished-waiting
    pending = set()
    for s in out["scheds"]:
        pending |= set(s.in_flight) | set(s.finished)
    assigned_later = {a.group_id for st_, c in out["steps"].items() if st_ >= steps for a in c}
    assert seen | pending | assigned_later == set(out["admitted"])
    assert not (seen & pending) and not (assigned_later & pending)


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.integers(1, 3),
    data=st.data(),
    lengths=lengths_st,
    steps=st.integers(1, 6),
)
def test_zero_staleness_is_synchronous(ranks, data, lengths, steps):
    """With K=0 step s holds exactly the prompts each rank admitted under version s, in
    admission order: the groups a synchronous run trains in step s."""
    quotas = data.draw(st.lists(st.integers(1, 4), min_size=ranks, max_size=ranks))
    speeds = data.draw(st.lists(st.floats(0.5, 20.0), min_size=ranks, max_size=ranks))
    concurrency = data.draw(st.lists(st.integers(1, 8), min_size=ranks, max_size=ranks))
    out = simulate(
        max_staleness=0,
        quotas=quotas,
        speeds=speeds,
        concurrency=concurrency,
        lengths=lengths,
        train_time=3.0,
        push_delay=[1.0] * ranks,
        steps=steps,
    )
    for step in range(steps):
        for r in range(ranks):
            got = sorted(
                a.group_id for a in out["steps"][step] if out["admitted"][a.group_id][0] == r
            )
            start = sum(quotas[r] for _ in range(step))
            assert got == out["order"][r][start : start + quotas[r]]
            assert all(out["admitted"][g][1] == step for g in got)


def test_rollout_waits_for_weights_when_too_stale():
    sched = StalenessScheduler(max_staleness=1, quota=2)
    for gid in range(4):  # steps 0 and 1 may be filled under version 0
        assert sched.can_admit(0, 0)
        sched.admit(gid, 0, 0)
    assert not sched.can_admit(0, 0)
    for gid in range(4):
        sched.finish(gid)
    placed = sched.assign_finished()
    assert [(a.group_id, a.step) for a in placed] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert sched.sealed_steps() == 2
    assert not sched.can_admit(0, 1)  # step 2 would be 2 versions past version 0
    assert not sched.can_admit(1, 3)  # trainer ahead by 2
    assert sched.can_admit(1, 2)


def test_late_group_holds_its_step_and_finished_work_is_kept():
    sched = StalenessScheduler(max_staleness=1, quota=1)
    sched.admit(0, 0)
    sched.admit(1, 0)
    sched.finish(1)
    assert [(a.group_id, a.step) for a in sched.assign_finished()] == [(1, 0)]
    # group 0 (deadline 1) is still generating: a newer group may start (deadline 2) but
    # must not take step 1 from it, and the old group is trained, not dropped
    sched.admit(2, 1, 1)
    assert not sched.can_admit(1, 1)
    sched.finish(2)
    assert sched.assign_finished() == []
    sched.finish(0)
    placed = sched.assign_finished()
    assert [(a.group_id, a.step, a.staleness) for a in placed] == [(0, 1, 1), (2, 2, 1)]


def test_protocol_errors_name_the_fix():
    sched = StalenessScheduler(max_staleness=0, quota=1)
    sched.admit(7, 0)
    with pytest.raises(StalenessError, match="twice"):
        sched.admit(7, 0)
    with pytest.raises(StalenessError, match="can_admit"):
        sched.admit(8, 0)
    with pytest.raises(StalenessError, match="not in flight"):
        sched.finish(9)
    with pytest.raises(ConfigError, match="max_staleness"):
        StalenessScheduler(max_staleness=-1, quota=1)
    with pytest.raises(ConfigError, match="quota"):
        StalenessScheduler(max_staleness=0, quota=0)


def test_state_dict_round_trip():
    sched = StalenessScheduler(max_staleness=2, quota=2)
    for gid in range(3):
        sched.admit(gid, 0)
    sched.finish(1)
    sched.assign_finished()
    clone = StalenessScheduler.from_state_dict(sched.state_dict())
    assert clone.state_dict() == sched.state_dict()
    assert clone.can_admit(0) == sched.can_admit(0)
