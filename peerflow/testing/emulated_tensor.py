"""Tensors on the emulated device: CPU values behind a device-typed wrapper.

An `EmulatedTensor` is a traceable wrapper subclass (`_make_wrapper_subclass`) whose device
is `emu:<index>` and whose values live in a CPU tensor, `elem`. Every operator on it
reaches `__torch_dispatch__`, which checks the devices as CUDA would (`emulated_rules`),
runs the operator on the CPU values and wraps the results; an in-place or `out=` operator
returns the caller's own tensor. Factories that name the device (`torch.empty(…,
device="emu")`) reach per-operator `PrivateUse1` kernels that do the same. New tensors
take the index their `device=` names, else their inputs' (all one, or CUDA's check has
refused the call), else the current one (`emulated_ordinals`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from peerflow.testing import emulated_ordinals, emulated_rules
from peerflow.testing.emulated_ordinals import DEVICE_TYPE

__all__ = ["DEVICE_TYPE", "EmulatedTensor", "emulated_device", "register_backend_kernels",
           "run_operator"]

_HOST = torch.device("cpu")

#: Operators whose `PrivateUse1` kernel this module provides: they run before any
#: emulated tensor exists (factories) or with the Python dispatch key excluded
#: (`torch.tensor(…, device=…)` copies its data that way).
BACKEND_KERNELS = ("empty.memory_format", "empty_strided", "_copy_from",
                   "_copy_from_and_resize", "tril_indices", "triu_indices")


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False
               ) -> torch.Tensor:
    return dst.copy_(src)


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    return dst.resize_(src.shape).copy_(src)


def _histc(values: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
           ) -> torch.Tensor:
    """`histc` as CUDA computes it, integer inputs included (the CPU kernel takes floats).

    transformers' grouped-MoE path counts expert ids with it on every device but the CPU.
    """
    if values.is_floating_point():
        return torch.ops.aten.histc(values, bins, min, max)
    return torch.ops.aten.histc(values.double(), bins, min, max).to(values.dtype)


#: Operators run on the values by a function here: backend-only ones (no CPU kernel: a
#: backend's copies), and ones whose CUDA kernel takes inputs the CPU's refuses.
ON_VALUES: dict[str, Callable[..., Any]] = {
    "aten::_copy_from": _copy_from, "aten::_copy_from_and_resize": _copy_from_and_resize,
    "aten::histc": _histc}

#: Operators that only order device work: nothing to do on the CPU values.
NO_OPS = frozenset({"aten::record_stream"})

#: The C++ addresses (`_cdata`) of the emulated device's generators: CPU generators that
#: serve it (a generator reaches `__torch_dispatch__` as a new Python object).
EMULATED_GENERATORS: set[int] = set()

#: Handlers for operator namespaces that are not computed on values (collectives), set by
#: `emulated_collectives`: namespace -> handler(func, args, kwargs).
NAMESPACE_HANDLERS: dict[str, Callable[[torch._ops.OpOverload, Sequence[Any],
                                         dict[str, Any]], Any]] = {}


def emulated_device() -> torch.device:
    """The current emulated device, `emu:<current index>` (valid once it is registered)."""
    return emulated_ordinals.current_device()


class EmulatedTensor(torch.Tensor):
    """A tensor on the emulated device; its values are the CPU tensor `elem`."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False,
                index: int | None = None) -> EmulatedTensor:
        """Wraps the CPU tensor `elem` (not copied) as a tensor on `emu:<index>`.

        Args:
            cls: `EmulatedTensor` (or a subclass).
            elem: The values.
            requires_grad: Whether autograd records operations on the tensor.
            index: The device's index; the current device's when None.
        """
        if index is None:
            index = emulated_ordinals.current_index()
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=torch.device(DEVICE_TYPE, index),
            requires_grad=requires_grad)
        wrapper.elem = elem
        return wrapper

    def __tensor_flatten__(self) -> tuple[list[str], int]:
        """The inner tensor's attribute name and the device index (traceable wrappers)."""
        return ["elem"], self.device.index

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: int | None,
                             outer_size: Any, outer_stride: Any) -> EmulatedTensor:
        """Rebuilds the wrapper from its inner tensor (traceable wrapper protocol)."""
        return EmulatedTensor(inner["elem"], index=meta)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """The CPU values' repr with the device and autograd state of this tensor."""
        text = repr(self.elem.detach())
        suffix = f", device='{self.device}'"
        if self.grad_fn is not None:
            suffix += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            suffix += ", requires_grad=True"
        return text[:-1] + suffix + ")"

    @property
    def data(self) -> torch.Tensor:
        """This tensor without autograd history, sharing its values."""
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if not isinstance(value, EmulatedTensor):
            raise RuntimeError(
                f"cannot set .data of a tensor on {self.device} to a tensor on {value.device}: "
                "the emulated device keeps its tensors' class (move it with .to() first)")
        torch._C.TensorBase.data.__set__(self, value)
        self.elem = value.elem

    def data_ptr(self) -> int:
        """The address of the CPU values (identifies aliasing like a device pointer)."""
        return self.elem.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The CPU values' storage: resizing it frees or reallocates them (FSDP2 does)."""
        return self.elem.untyped_storage()

    def tolist(self) -> Any:
        """The values as (nested) Python numbers (a device-to-host read, as on CUDA)."""
        return self.elem.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """Refused as CUDA refuses it: a device tensor has no host memory to share."""
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                        "Tensor.cpu() to copy the tensor to host memory first.")

    def __deepcopy__(self, memo: dict[int, Any]) -> EmulatedTensor:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = EmulatedTensor(self.elem.clone(), index=self.device.index)
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name != "elem":
                setattr(new, name, copy.deepcopy(value, memo))
        return new

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        """Pickles the CPU values and the index; unpickling needs the emulation installed."""
        return (rebuild, (self.elem.detach(), self.requires_grad, self.device.index))

    @classmethod
    def __torch_dispatch__(cls, func: torch._ops.OpOverload, types: Any,
                           args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        """Checks devices as CUDA would, runs `func` on the CPU values, wraps the results."""
        return run_operator(func, args, kwargs or {})


def rebuild(elem: torch.Tensor, requires_grad: bool, index: int = 0) -> EmulatedTensor:
    """Unpickles a device tensor (`EmulatedTensor.__reduce_ex__`): its CPU values on `index`."""
    count = emulated_ordinals.device_count()
    if index >= count:
        raise RuntimeError(f"Attempting to deserialize object on {DEVICE_TYPE} device {index} "
                           f"but torch.{DEVICE_TYPE}.device_count() is {count}.")
    return EmulatedTensor(elem, requires_grad=requires_grad, index=index)


def _unwrap(value: Any, held: dict[int, Any]) -> Any:
    if isinstance(value, EmulatedTensor):
        held[id(value.elem)] = value
        return value.elem
    if isinstance(value, torch.Tensor):
        held[id(value)] = value
        return value
    if isinstance(value, torch.device):
        return _HOST if value.type == DEVICE_TYPE else value
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(item, held) for item in value)
    return value


def _wrap(value: Any, held: dict[int, Any], index: int | None) -> Any:
    if isinstance(value, torch.Tensor):
        original = held.get(id(value))
        if original is not None:
            return original
        if index is None or type(value) is not torch.Tensor:
            return value
        if not value.is_inference() and torch.is_inference_mode_enabled():
            # A view of a normal tensor is a normal tensor, in inference mode too (autograd
            # then shares its version counter with the base's).
            with torch.inference_mode(False):
                return EmulatedTensor(value, index=index)
        return EmulatedTensor(value, index=index)
    if isinstance(value, (list, tuple)):
        return type(value)(_wrap(item, held, index) for item in value)
    return value


def _first_index(values: Any) -> int | None:
    """The device index of the first emulated tensor among `values` (one level deep)."""
    for value in values:
        if isinstance(value, EmulatedTensor):
            return value.device.index
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, EmulatedTensor):
                    return item.device.index
    return None


def _placement(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
               ) -> int | None:
    """The index of the emulated device `func`'s results live on, or None (the host).

    The one `device=` names (the current one when it names no index), else the inputs'.
    """
    device = kwargs.get("device")
    if device is None:
        index = _first_index(args)
        if index is None:
            index = _first_index(kwargs.values())
        return emulated_ordinals.current_index() if index is None else index
    device = torch.device(device)
    if device.type != DEVICE_TYPE:
        return None
    try:
        return emulated_ordinals.index_of(device)
    except RuntimeError as error:
        raise RuntimeError(f"{func}: {error}") from None


def _check_generator(kwargs: dict[str, Any]) -> None:
    generator = kwargs.get("generator")
    if generator is not None and generator._cdata not in EMULATED_GENERATORS:
        raise RuntimeError(f"Expected a '{DEVICE_TYPE}' device type for generator but found "
                           f"'{generator.device.type}'")


def _resync(held: dict[int, Any]) -> None:
    """Matches each written wrapper's shape to its values after a resizing operator."""
    for original in held.values():
        if not isinstance(original, EmulatedTensor):
            continue
        elem = original.elem
        if (original.shape != elem.shape or original.stride() != elem.stride()
                or original.storage_offset() != elem.storage_offset()):
            torch._C.TensorBase.data.__set__(
                original, EmulatedTensor(elem, index=original.device.index))


def run_operator(func: torch._ops.OpOverload, args: Sequence[Any],
                 kwargs: dict[str, Any], namespace_handled: bool = False) -> Any:
    """Runs one operator call that involves the emulated device.

    Args:
        func: The operator overload.
        args: Its positional arguments (emulated tensors, CPU tensors, anything else).
        kwargs: Its keyword arguments.
        namespace_handled: Set by a `NAMESPACE_HANDLERS` handler that has prepared the
            call, to run it here.

    Returns:
        The operator's results: new ones on the emulated device (its index from `device=`,
        else the inputs'; on the host where `device=` says so), written arguments as the
        caller's own tensors.

    Raises:
        RuntimeError: where CUDA would refuse this mix of devices, with its message.
    """
    handler = None if namespace_handled else NAMESPACE_HANDLERS.get(func.namespace)
    if handler is not None:
        return handler(func, args, kwargs)
    if func._schema.name in NO_OPS:
        return None
    emulated_rules.check_devices(func, args, kwargs)
    index = _placement(func, args, kwargs)
    if index is not None:
        _check_generator(kwargs)
    held: dict[int, Any] = {}
    run = ON_VALUES.get(func._schema.name, func)
    result = run(*_unwrap(args, held), **{key: _unwrap(value, held)
                                          for key, value in kwargs.items()})
    if func._schema.is_mutable:
        _resync(held)
    return _wrap(result, held, index)


def _kernels_instead_of_decompositions() -> list[str]:
    """Operators with a CPU kernel (so a CUDA one) that would decompose on this device.

    A backend without a kernel of its own gets an operator's `CompositeImplicitAutograd`
    decomposition (`silu_backward`, …), whose numerics differ from the CPU's kernel;
    registering one makes the operator reach `__torch_dispatch__` whole, to run the CPU
    kernel. (`scaled_dot_product_attention` still takes its math path: torch picks fused
    kernels only for the devices it knows.)
    """
    names = [name for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("aten::")
             and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
             and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")]
    return [name.split("::", 1)[1] for name in names]


def register_backend_kernels(library: torch.library.Library) -> None:
    """Registers the `PrivateUse1` kernels of the emulated device in `library` (`aten`)."""
    for name in (*BACKEND_KERNELS, *_kernels_instead_of_decompositions()):
        base, _, overload = name.partition(".")
        func = getattr(getattr(torch.ops.aten, base), overload or "default")

        def kernel(*args: Any, _func: torch._ops.OpOverload = func, **kwargs: Any) -> Any:
            return run_operator(_func, args, kwargs)

        library.impl(name, kernel, "PrivateUse1")
