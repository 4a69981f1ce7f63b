"""Collectives of the emulated device: the `emunccl` c10d backend.

gloo refuses `PrivateUse1` tensors, and NCCL is what CUDA tensors travel over, so the
emulated device gets a backend of its own, registered for it only (as NCCL serves CUDA
only): `torch.distributed.get_default_backend_for_device("emu")` is `"emunccl"`, and

* `init_process_group(backend="cpu:gloo,emu:emunccl")` gives a group that carries host
  tensors over gloo and device tensors over `emunccl`, as `"cpu:gloo,cuda:nccl"` does;
* `backend="emunccl"` gives a device-only group, on which a host tensor fails inside c10d
  exactly as on an NCCL-only group: "No backend type associated with device type cpu".

An `emunccl` backend is a gloo process group of its own (own store prefix, own
connections). c10d runs a collective as an operator (`c10d::allreduce_`, …,
`_c10d_functional::all_reduce`, …) dispatched on its tensors, so one on emulated tensors
reaches `EmulatedTensor.__torch_dispatch__`; it is re-issued here on the CPU values,
through a shadow process group whose host backend is the group's device backend. The
group's own device backend does the work, so a group without one fails as c10d would.
gloo also serves the emulated device, as it serves CUDA.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from peerflow.testing import emulated_rules
from peerflow.testing.emulated_tensor import DEVICE_TYPE, NAMESPACE_HANDLERS, run_operator

#: The c10d backend of the emulated device (its "NCCL").
BACKEND_NAME = "emunccl"
#: A process-group backend string carrying host tensors over gloo, device ones over it.
GROUP_BACKEND = f"cpu:gloo,{DEVICE_TYPE}:{BACKEND_NAME}"
#: Operator namespaces of c10d collectives.
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")

#: Operators that wrap their input in a Python subclass (no collective, no values): run
#: on the emulated tensor itself.
WRAPPERS = frozenset({"_c10d_functional::_wrap_tensor_autograd"})

_lock = threading.Lock()
#: Shadow groups by the id of the device backend they serve, with the name each is
#: registered under in c10d and the backend's Python object: holding that object keeps
#: its id unique, and makes c10d hand out the same object for the backend again (a
#: wrapper left to die would free its id for the next group's backend, whose collectives
#: would then go to this group's connections on one rank and hang).
_shadows: dict[int, tuple[dist.ProcessGroup, str, Any]] = {}


def _create_backend(store: dist.Store, rank: int, size: int,
                    timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The `emunccl` backend of one group: a gloo group over connections of its own."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(dist.PrefixStore(f"{BACKEND_NAME}/", store), rank, size,
                            timeout=timeout)


def _shadow(group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, str]:
    """A group whose host backend is `group`'s emulated-device backend, and its name.

    Raises:
        RuntimeError: `group` has no backend for the emulated device (c10d's message).
    """
    backend = group._get_backend(torch.device(DEVICE_TYPE))
    with _lock:
        found = _shadows.get(id(backend))
        if found is None:
            shadow = dist.ProcessGroup(group.rank(), group.size())
            shadow._register_backend(torch.device("cpu"),
                                     dist.ProcessGroup.BackendType.CUSTOM, backend)
            shadow._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
            # Named in c10d's registry only: naming the group itself would rename the
            # backend it shares with `group`.
            name = f"{group.group_name}:{DEVICE_TYPE}:{len(_shadows)}"
            torch._C._distributed_c10d._register_process_group(name, shadow)
            found = _shadows[id(backend)] = (shadow, name, backend)
    return found[0], found[1]


def _reroute(value: Any, argument: torch.Argument) -> Any:
    """An argument of a c10d operator, its process group replaced by the shadow group."""
    if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(argument.type):
        return _shadow(dist.ProcessGroup.unbox(value))[0].boxed()
    if argument.name == "group_name" and isinstance(value, str):
        return _shadow(torch._C._distributed_c10d._resolve_process_group(value))[1]
    return value


def run_collective(func: torch._ops.OpOverload, args: Sequence[Any],
                   kwargs: dict[str, Any]) -> Any:
    """Runs a c10d operator on emulated tensors over their group's device backend.

    Args:
        func: The c10d operator (`c10d::allreduce_`, `_c10d_functional::all_reduce`, …).
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The operator's results, tensors on the emulated device.

    Raises:
        RuntimeError: the group has no backend for the emulated device (c10d's message).
    """
    if func._schema.name in WRAPPERS:
        with torch._C._DisableTorchDispatch():
            return func(*args, **kwargs)
    schema_arguments = func._schema.arguments
    args = [_reroute(value, schema_arguments[index]) if index < len(schema_arguments)
            else value for index, value in enumerate(args)]
    by_name = {argument.name: argument for argument in schema_arguments}
    kwargs = {key: _reroute(value, by_name[key]) if key in by_name else value
              for key, value in kwargs.items()}
    return run_operator(func, args, kwargs, namespace_handled=True)


def register() -> None:
    """Registers `emunccl` for the emulated device and routes c10d operators on its tensors.

    Also lists the emulated device among gloo's (gloo serves CUDA tensors too).
    """
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, devices=[DEVICE_TYPE])
    gloo_devices = dist.Backend.backend_capability.get(dist.Backend.GLOO)
    if gloo_devices is not None and DEVICE_TYPE not in gloo_devices:
        gloo_devices.append(DEVICE_TYPE)
    for namespace in NAMESPACES:
        NAMESPACE_HANDLERS[namespace] = run_collective
    emulated_rules.UNCHECKED_NAMESPACES.update(NAMESPACES)
