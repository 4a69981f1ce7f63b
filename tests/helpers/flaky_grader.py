"""A reward function whose grader is down for some answers (tests of `reward_limits.on_failure`).

It raises for answers whose length is a multiple of 3 and scores the others by how many
distinct characters they use, so groups of sampled answers have a spread.
"""

from __future__ import annotations


def score(response: str, example: dict) -> float:
    """`(distinct characters mod 5) / 4`; raises for answers of length divisible by 3."""
    if len(response) % 3 == 0:
        raise RuntimeError("grader service unavailable")
    return (len(set(response)) % 5) / 4
