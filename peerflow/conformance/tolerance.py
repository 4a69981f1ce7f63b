"""Log-prob tolerances derived from how much the reference itself varies.

A fixed tolerance tuned on one CPU fails on another whose float32 kernels round
differently (a machine with `avx512_bf16` picks other oneDNN GEMM and attention kernels),
and it says nothing about how far out an engine really is. So the suite scores the
tokens with its reference (a plain `transformers` model, or transformers + peft for
LoRA) along several numerical paths:

* float64 — the value engines are compared with;
* float32 with eager attention and float32 with SDPA attention — two kernel paths of
  the precision engines run in.

The reference's **spread** is the largest difference between those paths on the very
tokens under test: the float32 rounding noise of this model on this machine. An engine
passes within `FACTOR` × spread (an engine's float32 kernels may sum in another order;
a layout or temperature bug is off by orders of magnitude more), and never below
`FLOOR`. The failure message states the spread and the paths, so a reader sees how far
out the engine is compared with the reference's own noise.

An author who needs a fixed value overrides the suite's `logprob_atol` fixture with a
float; the default (`None`) derives it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

#: Multiple of the reference's own spread an engine may differ by.
FACTOR = 10.0
#: Smallest tolerance: float32 noise of a tiny model can be below any engine's.
FLOOR = 2e-5
#: Numerical paths the reference is scored along: `(dtype, attention implementation)`.
PATHS = ((torch.float64, "eager"), (torch.float32, "eager"), (torch.float32, "sdpa"))

#: Scores rows along one path: `(dtype, attn_implementation) -> log-probs per row`.
Scorer = Callable[[torch.dtype, str], list[torch.Tensor]]


@attrs.frozen(kw_only=True)
class Tolerance:
    """How close an engine's log-probs must be to the float64 reference, and why."""

    atol: float
    """The tolerance."""
    spread: float | None
    """Largest difference between the reference's own numerical paths (`None`: fixed)."""
    paths: str = ""
    """The paths the spread is taken over, for messages."""

    def explain(self) -> str:
        """One sentence for a failure message: the tolerance and where it comes from."""
        if self.spread is None:
            return f"tolerance {self.atol:.2e} (fixed by the suite's logprob_atol fixture)"
        return (f"tolerance {self.atol:.2e} = max({FACTOR:g} x the reference's own spread "
                f"{self.spread:.2e} across {self.paths}, floor {FLOOR:.0e})")


def worst_gap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference between two lists of log-prob rows (inf on length mismatch)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def derive(score: Scorer, fixed: float | None = None) -> tuple[list[torch.Tensor], Tolerance]:
    """Scores along every path; returns the float64 log-probs and the tolerance.

    Args:
        score: Scores the rows under test along one `(dtype, attention)` path.
        fixed: A tolerance to use instead of deriving one (the `logprob_atol` fixture).
    """
    (first_dtype, first_attn), *others = PATHS
    truth = [t.double() for t in score(first_dtype, first_attn)]
    if fixed is not None:
        return truth, Tolerance(atol=float(fixed), spread=None)
    spread = max(worst_gap(truth, score(dtype, attn)) for dtype, attn in others)
    paths = ", ".join(f"{str(d).removeprefix('torch.')} {a}" for d, a in PATHS)
    return truth, Tolerance(atol=max(FLOOR, FACTOR * spread), spread=spread, paths=paths)
