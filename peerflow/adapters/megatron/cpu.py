"""Redirects that megatron-core needs to run off CUDA (the CPU, or another accelerator).

megatron-core 0.16 assumes CUDA in a few places on the forward/backward path:
`torch.cuda.current_device()` as the device of freshly allocated tensors (rotary
embedding frequencies, pipeline send/recv buffers, the global memory buffer, attention
masks), and the CUDA RNG tracker (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker`)
reading and writing `torch.cuda` RNG state.

The redirect is confined to Megatron's own modules and to runs off CUDA; the engine's
device is the *target*:

* every loaded `megatron.*` module whose global `torch` is the real torch module gets a
  thin proxy instead, identical to torch except that `torch.cuda.current_device()` is
  the target, `torch.cuda.{get,set}_rng_state`/`manual_seed` use the CPU generator and
  `torch.cuda.synchronize` is a no-op, and tensor factories (`zeros`, `ones`, `empty`,
  `full`, `tensor`, `arange`) called with `device="cuda"` allocate on the target. Nothing
  outside `megatron.*` (PeerFlow, vLLM, transformers, user code) sees a change;
  `torch.cuda.is_available()` stays `False`;
* Megatron's RNG tracker helpers `_get_cuda_rng_state` / `_set_cuda_rng_state` use the CPU
  generator, so `get_cuda_rng_tracker().fork()` saves and restores real state;
* `get_default_causal_mask` (a `device="cuda"` literal in `megatron.core.transformer.
  utils`, imported by name into the softmax fusions) builds the causal mask on the target.

`tensor_cuda_is_identity()` covers one more spot: `GPTModel.__init__` with tied embeddings
and pp > 1 moves the last stage's embedding copy with `tensor.cuda()` before all-reducing
it; the adapter builds the model inside this context manager, which makes
`torch.Tensor.cuda` return the tensor unchanged for the duration of the build only.

`enable_redirects(device)` is called by the Megatron adapter only when its device is not
CUDA; it is idempotent and re-applies to Megatron modules imported since.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

#: Where Megatron's CUDA allocations land (`enable_redirects` sets it).
_TARGET: list[torch.device] = [torch.device("cpu")]


class _CudaOffCuda:
    """`torch.cuda` as Megatron sees it off CUDA (everything else falls through)."""

    @staticmethod
    def current_device() -> torch.device:
        return _TARGET[0]

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @property
    def random(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(get_rng_state=self.get_rng_state,
                                     set_rng_state=self.set_rng_state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


#: Tensor factories Megatron calls with a literal `device="cuda"` (schedules' token
#: counters, DDP warm-up buffers, masks).
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


def _on_target(factory: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = _TARGET[0]
        return factory(*args, **kwargs)

    return call


class _TorchOffCuda:
    """The `torch` module with `cuda` replaced by `_CudaOffCuda`, CUDA factories on target."""

    cuda = _CudaOffCuda()

    def __init__(self) -> None:
        for name in _FACTORIES:
            setattr(self, name, _on_target(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_PROXY = _TorchOffCuda()


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False,
                       graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1,
                       graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _target_causal_mask(sq: int) -> torch.Tensor:  # [sq, sq] bool, True above the diagonal
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=_TARGET[0]), diagonal=1)


def needs_redirects(device: torch.device) -> bool:
    """Whether the adapter must redirect Megatron's CUDA calls (a device other than CUDA)."""
    return device.type != "cuda"


def enable_redirects(device: str | torch.device = "cpu") -> int:
    """Applies the redirects to every loaded `megatron.*` module; returns how many changed.

    Args:
        device: Where Megatron's `device="cuda"` allocations go (the engine's device).
    """
    _TARGET[0] = torch.device(device)
    changed = 0
    for name, module in list(sys.modules.items()):
        if not (name == "megatron" or name.startswith("megatron.")) or module is None:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = _PROXY
            changed += 1
        if callable(getattr(module, "get_default_causal_mask", None)):
            module.get_default_causal_mask = _target_causal_mask
        if name == "megatron.core.tensor_parallel.random":
            module._get_cuda_rng_state = _cpu_get_rng_state
            module._set_cuda_rng_state = _cpu_set_rng_state
    return changed


@contextlib.contextmanager
def tensor_cuda_is_identity(active: bool = True) -> Iterator[None]:
    """While active, `torch.Tensor.cuda()` returns the tensor itself (model build only)."""
    if not active:
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original
