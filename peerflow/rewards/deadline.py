"""The wall-clock deadline of the reward call a process is running (set by the pool).

`RewardPool` kills a call that runs past `task.reward_limits.timeout_s`, and a killed call
is an infrastructure timeout. A reward that runs programs (`code`) reads `seconds_left()`
and gives each program a sandbox time limit that ends before the deadline, so a program
that runs out of time is stopped, cleaned up and scored as a wrong answer instead.
"""

from __future__ import annotations

import time

_DEADLINE: list[float] = []


def start(timeout_s: float | None) -> None:
    """Marks the start of a call that may run `timeout_s` seconds (`None`: no deadline)."""
    _DEADLINE[:] = [] if timeout_s is None else [time.monotonic() + timeout_s]


def seconds_left() -> float | None:
    """Seconds until the current call's deadline; `None` outside a pool call."""
    return _DEADLINE[0] - time.monotonic() if _DEADLINE else None
