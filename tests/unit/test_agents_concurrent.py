"""`run_with_limits`: calls at once, each under its own limit; a hung call frees its slot."""

from __future__ import annotations

import threading

from peerflow.agents.concurrent import run_with_limits


def test_a_hung_call_times_out_and_the_queued_ones_still_run():
    release = threading.Event()
    ran = []

    def hang():
        release.wait(60)
        return "late"

    def quick(i):
        ran.append(i)
        return i * 10

    def boom():
        raise ValueError("bad")

    try:
        out = run_with_limits([hang, lambda: quick(1), boom, lambda: quick(2)],
                              timeout_s=0.3, concurrency=1)
    finally:
        release.set()
    assert [o.timed_out for o in out] == [True, False, False, False]
    assert out[0].value is None and not out[0].ok  # the late answer is not taken
    assert [out[1].value, out[3].value] == [10, 20] and ran == [1, 2]
    assert isinstance(out[2].error, ValueError) and not out[2].ok


def test_at_most_concurrency_calls_run_at_once():
    lock, live, peak = threading.Lock(), [0], [0]
    gate = threading.Barrier(2, timeout=10)

    def call():
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        gate.wait()  # two calls must be in flight together to pass
        with lock:
            live[0] -= 1
        return True

    out = run_with_limits([call] * 6, timeout_s=30, concurrency=2)
    assert all(o.ok and o.value for o in out)
    assert peak[0] == 2
