"""An emulated accelerator: test device code without a GPU.

`install()` makes this process believe it runs on a host with one accelerator per local
rank, `emu:0` … `emu:<n-1>` (`torch.accelerator.current_accelerator()` is
`torch.device("emu")`, `torch.accelerator.device_count()` is `$LOCAL_WORLD_SIZE`, or
`$PEERFLOW_EMULATED_DEVICES` when set), whose tensors hold real values computed on the
CPU, and which refuses every mix of devices that CUDA refuses, host/device and
`emu:0`/`emu:1` alike, with CUDA's messages ("Expected all tensors to be on the same
device, but found at least two devices, emu:0 and cpu!"). Code that decides its devices
through `torch.accelerator` runs its GPU path here (`peerflow.distributed.devices` gives
each local rank a device of its own and NCCL's stand-in, `emunccl`), so a CPU-only test run
catches the placement bugs that otherwise surface only on a GPU machine.

Parts (each its own module):

* **The device** (`emulated_runtime`): the `PrivateUse1` backend registered from Python and
  renamed `emu`, its `torch.emu` module (streams, events, RNG, memory figures),
  `torch.Generator("emu")`.
* **Its indices** (`emulated_ordinals`): how many devices, which one is current
  (`torch.accelerator.set_device_index`, 0 at start), and the device a tensor named
  `"emu"`, without an index, lands on (the current one, as on CUDA).
* **Its tensors** (`emulated_tensor`): a traceable wrapper subclass over a CPU tensor;
  every operator is checked with CUDA's rules (`emulated_rules`, read from torch's own
  `native_functions.yaml`) and run on the CPU values.
* **Collectives** (`emulated_collectives`): the `emunccl` c10d backend, serving the device
  only (as NCCL serves CUDA only), over a gloo connection of its own.
* **DeepSpeed** (`emulated_deepspeed`): an accelerator for the device, set when DeepSpeed
  is installed.

Use it in a process of its own: with `PEERFLOW_EMULATE_ACCELERATOR=1` in the environment,
torch's device-extension hook (`peerflow.testing.autoload`) installs it at the process's
first `torch.accelerator` question; or call `install()` (`install_from_env()`) yourself
once, at start-up, before the process's first backward pass (autograd sizes its per-device
worker threads then) and before any process group or DeepSpeed engine exists. It cannot be
undone. Nothing in PeerFlow's production code imports this package.

Limits:

* No autocast: `torch.autocast("emu", dtype=torch.bfloat16)` is accepted and computes in
  fp32. No fused kernels: scaled-dot-product attention takes its math path (values within
  ~1e-5 of the CPU's flash kernel; eager attention matches the CPU bit for bit).
* No stream or event races: all work is synchronous; streams and events only keep books.
* `torch.compile`d code runs eagerly: dynamo's errors on emulated tensors (it fakes their
  storage on `meta`) fall back to the eager frame (`_compile_eagerly`).
* Devices are names: every index's values live in this process's CPU memory, each
  process has its own (rank 1's `emu:1` and rank 0's `emu:1` are not one device), and a
  copy between indices is a CPU copy. The count is read at `install()`
  (`$PEERFLOW_EMULATED_DEVICES`, else `$LOCAL_WORLD_SIZE`, at least 1); with fewer devices
  than local ranks, ranks share devices (`peerflow.distributed.devices` then carries device
  tensors over gloo, which serves the emulated device too).
* The current device is the process's, not each thread's as on CUDA (a thread that never
  set its device computes on the process's current one here, on device 0 on a GPU).
* With more than one device, every backward pass runs on its caller's thread (autograd's
  per-device threads exist for device 0 only), and `Tensor.to`, `torch.tensor`,
  `torch.as_tensor`, `torch.asarray` and `Tensor.new_tensor` are wrapped so that `"emu"`
  without an index names the current device (torch's C++ side would name device 0).
  A `device="emu"` that reaches C++ another way (`torch.set_default_device("emu")` or
  another torch function mode, an operator called from C++ with `emu` and no index) lands
  on `emu:0`. The wrappers are not torch's builtins: code that looks those up by identity
  misses them (the device context, `with torch.device(…)`, and lazy modules are covered).
* Things a Python backend cannot provide: `pin_memory()` returns an unpinned copy; a CPU
  operator handed an `emu` generator runs instead of failing; `.data = cpu_tensor` on an
  emulated tensor raises (CUDA allows it); `torch.load(weights_only=True)` refuses pickled
  emulated tensors.
* Process-wide patches: `torch.Generator` (accepts `"emu"`), `Tensor.pin_memory`,
  `torch.utils.swap_tensors` (swaps parameters with weak references onto the device, as
  DeepSpeed's `module.to()` needs), `torch.accelerator`'s `synchronize`, device-index and
  stream functions and memory statistics (answered for the emulated device), and with more
  than one device those of the previous point.
* Private torch APIs (`_setup_privateuseone_for_python_backend`, wrapper subclasses,
  c10d's operator dispatch, torchgen's `native_functions.yaml`): a torch upgrade needs the
  smoke test (`tests/unit/test_emulated_device.py`); on a torch without them `install()`
  raises a `RuntimeError` naming the version and the fix, and the tests skip.

Cost: every operator on an emulated tensor goes through Python dispatch, about 17 µs
more per operator (a tiny Llama's training step runs ~6x slower than on the CPU; large
matrix products at CPU speed). `install()` takes about 0.5 s (it reads torch's operator
table, and imports DeepSpeed when installed).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from peerflow.testing.emulated_collectives import BACKEND_NAME, GROUP_BACKEND
from peerflow.testing.emulated_ordinals import ENV_VAR as DEVICES_ENV_VAR
from peerflow.testing.emulated_tensor import DEVICE_TYPE, EmulatedTensor, emulated_device
from peerflow.testing.env import ENV_VAR

__all__ = ["BACKEND_NAME", "DEVICES_ENV_VAR", "DEVICE_TYPE", "ENV_VAR", "GROUP_BACKEND",
           "EmulatedTensor", "install", "install_from_env", "is_installed",
           "unsupported_reason"]

_lock = threading.Lock()
_installed = False
_failure: RuntimeError | None = None
_libraries: list[torch.library.Library] = []

#: What the emulation is built on: (owner, attribute) pairs this torch must have.
_REQUIRED = (
    ("torch.utils.backend_registration", "_setup_privateuseone_for_python_backend"),
    ("torch.Tensor", "_make_wrapper_subclass"),
    ("torch._C._acc", "PrivateUse1Hooks"),
    ("torch._C._acc", "DeviceGuard"),
    ("torch.accelerator", "current_accelerator"),
    ("torch.library.Library", "fallback"),
)


def unsupported_reason() -> str | None:
    """Why this torch cannot host the emulation, or None when it can."""
    import importlib

    missing = []
    for owner, name in _REQUIRED:
        module_name, _, attribute = owner.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            found = None
        if not hasattr(found, name):
            missing.append(f"{owner}.{name}")
    if not missing:
        return None
    return (f"torch {torch.__version__} lacks {', '.join(missing)}, which the emulated "
            "accelerator (peerflow.testing) is built on: install the torch version PeerFlow "
            "pins (constraints-cpu.txt), or port peerflow/testing to this one")


def is_installed() -> bool:
    """Whether `install()` has completed in this process."""
    return _installed


def _hooks_and_guard() -> tuple[Any, Any]:
    """The `PrivateUse1` hooks and device guard of the emulated device."""

    class Hooks(torch._C._acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return True

        def has_primary_context(self, device_index: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    class Guard(torch._C._acc.DeviceGuard):
        def type_(self) -> torch._C._autograd.DeviceType:
            return torch._C._autograd.DeviceType.PrivateUse1

    return Hooks(), Guard()


def _register_device() -> None:
    """Registers `PrivateUse1` as the `emu` device with its module, hooks and kernels."""
    from torch.utils import backend_registration

    from peerflow.testing import emulated_runtime
    from peerflow.testing.emulated_tensor import register_backend_kernels

    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        raise RuntimeError(
            "the PrivateUse1 backend is already registered as "
            f"{torch._C._get_privateuse1_backend_name()!r} in this process; the emulated "
            "accelerator needs it (run it in a process of its own)")
    hooks, guard = _hooks_and_guard()
    backend_registration._setup_privateuseone_for_python_backend(
        rename=DEVICE_TYPE, backend_module=emulated_runtime.build_device_module(),
        hook=hooks, device_guard=guard)
    kernels = torch.library.Library("aten", "IMPL")
    register_backend_kernels(kernels)
    # Autocast on the device is accepted and changes nothing (no casting policy).
    fallbacks = torch.library.Library("_", "IMPL")
    fallbacks.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _libraries.extend((kernels, fallbacks))
    emulated_runtime.patch_torch()


def _check_autograd() -> None:
    """Runs a backward pass on the device: the autograd engine must know it.

    Raises:
        RuntimeError: a backward pass ran in this process before `install()`.
    """
    probe = EmulatedTensor(torch.ones(1), requires_grad=True)
    try:
        (probe * 2).sum().backward()
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        raise RuntimeError(
            "peerflow.testing.emulated_device.install() ran after this process's first "
            "backward pass: autograd sized its device queues then and cannot run the "
            "emulated device's backward. Install it at process start (install_from_env() "
            f"first thing in the worker, with ${ENV_VAR}=1).") from error


def _install_deepspeed_accelerator() -> None:
    """Makes DeepSpeed place its engines on the emulated device, when it is installed."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return
    from peerflow.testing import emulated_deepspeed

    emulated_deepspeed.set_accelerator()


def _compile_eagerly() -> None:
    """`torch.compile`d code runs eagerly on the emulated device.

    Dynamo fakes a tensor's storage on the meta device to trace it, which a Python tensor
    subclass on another device refuses ("Attempted to set the storage of a tensor on
    device emu:0 to a storage on different device meta"); megatron-core compiles its MoE
    helpers (`jit_fuser`). Falling back to the eager frame runs the same operators, each
    checked as CUDA would check it.
    """
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True


def install() -> torch.device:
    """Installs the emulated accelerator in this process (idempotent).

    The device count is read now: `$PEERFLOW_EMULATED_DEVICES`, else `$LOCAL_WORLD_SIZE`
    (at least 1).

    Returns:
        The current emulated device (`torch.device("emu", 0)` after the first install).

    Raises:
        RuntimeError: this torch lacks the private APIs the emulation needs (the message
            names the version and the fix), another backend holds `PrivateUse1`, a
            backward pass already ran in this process, or `$PEERFLOW_EMULATED_DEVICES` is
            not a device count. An install that failed part-way raises the same error again.
    """
    global _installed, _failure
    with _lock:
        if _installed:
            return emulated_device()
        if _failure is not None:
            raise _failure
        reason = unsupported_reason()
        if reason is not None:
            raise RuntimeError(reason)
        from peerflow.testing import emulated_collectives, emulated_ordinals, emulated_rules

        try:
            emulated_ordinals.configure()
            emulated_rules.rule_table()
            _register_device()
            _check_autograd()
        except RuntimeError as error:
            _failure = error
            raise
        emulated_ordinals.patch_torch()
        emulated_collectives.register()
        _install_deepspeed_accelerator()
        _compile_eagerly()
        _installed = True
    return emulated_device()


def install_from_env() -> torch.device | None:
    """Installs the emulation when `$PEERFLOW_EMULATE_ACCELERATOR` is "1".

    Returns:
        The emulated device when installed, else None.
    """
    if os.environ.get(ENV_VAR) != "1":
        return None
    return install()
