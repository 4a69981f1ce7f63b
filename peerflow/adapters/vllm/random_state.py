"""`EngineRandomState`: the vLLM engine's own torch RNG stream, kept apart from the caller's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class EngineRandomState:
    """torch's global RNG state of the engine, swapped in around every call into vLLM.

    In-process vLLM (the default executor) runs its sampler in the caller's process: it
    reseeds torch's global RNG when it starts (`LLM(seed=…)`) and samples unseeded
    requests from the default generator. A colocated trainer draws from that stream too
    (dropout, data order), so without the swap its run would depend on the rollout. The
    engine keeps a stream of its own (still random across calls), and the caller's is
    restored after every call.
    """

    def __init__(self) -> None:
        self.cpu: torch.Tensor | None = None
        self.cuda: torch.Tensor | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Runs the block on the engine's RNG state; the caller's is restored after."""
        caller_cpu = torch.get_rng_state()
        caller_cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        if self.cuda is not None and caller_cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(caller_cpu)
            if torch.cuda.is_initialized():
                self.cuda = torch.cuda.get_rng_state()
                if caller_cuda is not None:
                    torch.cuda.set_rng_state(caller_cuda)
