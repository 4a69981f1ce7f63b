"""CUDA's device-placement rules, read from torch's own operator table.

CUDA checks devices in three places, and the emulated device repeats each with the same
message:

1. **The generated wrapper** of every CUDA kernel whose operator is not marked
   `device_check: NoCheck` in `native_functions.yaml` (packaged with torchgen): the `out=`
   arguments, then the positional ones, must all be on one device
   (`c10::impl::check_and_update_common_device`).
2. **TensorIterator** (the `NoCheck` operators): every operand on the first non-CPU device
   among them, except 0-dim CPU inputs ("CPU scalars").
3. **Structured `out=` kernels**: an `out=` tensor must be on the inputs' device
   ("Expected out tensor to have device …").

Indexing is special: a device tensor may be indexed by CPU indices, a CPU tensor not by
device ones. Copies (`copy_`, `_to_copy`, …) cross devices by definition. A composite
operator (no CUDA kernel of its own) is checked like a TensorIterator one: CUDA checks the
kernels it decomposes into, which this emulation does not see.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

#: Operators that move data between devices: never checked.
CROSS_DEVICE = frozenset({
    "copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "to", "lift_fresh",
    "lift_fresh_copy", "_has_compatible_shallow_copy_type", "set_", "record_stream",
    "_local_scalar_dense", "detach", "alias", "_foreach_copy_", "_foreach_copy",
    "_nested_tensor_from_tensor_list",
})

#: Indexing operators: `indices` may stay on the CPU when `self` is on the device.
INDEXING = frozenset({"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_",
                      "_unsafe_index_put"})

#: Operator namespaces not checked here (c10d's collectives check their own devices).
UNCHECKED_NAMESPACES: set[str] = set()

#: Where CUDA's messages name a kernel, they name CUDA's (so logs read as on a GPU).
KERNEL_PREFIX = "wrapper_CUDA_"


class OpRule(NamedTuple):
    """How CUDA checks the devices of one operator overload."""

    strict: bool
    """Not `NoCheck` and a CUDA kernel of its own: every checked tensor on one device."""
    iterator: bool
    """A TensorIterator kernel: a misplaced `out=` reads as two devices, not as `out`."""
    schema: str
    """The overload's schema text (for the kernel name in messages)."""
    structured: bool
    """A structured kernel (changes the CUDA wrapper's name)."""


def _yaml_path() -> str:
    import torchgen

    return os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native",
                        "native_functions.yaml")


def _has_cuda_kernel(entry: dict[str, Any]) -> bool:
    if entry.get("structured_delegate"):
        return True
    keys = ",".join(entry.get("dispatch") or {})
    return any(key.strip() == "CUDA" for key in keys.split(","))


@functools.lru_cache(maxsize=1)
def rule_table() -> dict[str, OpRule]:
    """Every `aten` overload's rule, keyed `"name.overload"` (`"mm"`, `"add.Tensor"`).

    Raises:
        RuntimeError: torch's packaged `native_functions.yaml` is missing.
    """
    import yaml

    path = _yaml_path()
    if not os.path.exists(path):
        raise RuntimeError(
            f"torch {torch.__version__} ships no torchgen operator table at {path}; the "
            "emulated device reads CUDA's device checks from it. Install a full torch wheel.")
    with open(path) as stream:
        entries = yaml.load(stream, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    by_name = {entry["func"].split("(", 1)[0]: entry for entry in entries}

    def iterator(entry: dict[str, Any]) -> bool:
        if entry.get("structured_inherits") == "TensorIteratorBase":
            return True
        delegate = by_name.get(entry.get("structured_delegate") or "")
        return bool(delegate and delegate.get("structured_inherits") == "TensorIteratorBase")

    return {
        name: OpRule(
            strict=entry.get("device_check") != "NoCheck" and _has_cuda_kernel(entry),
            iterator=iterator(entry),
            schema=entry["func"],
            structured=bool(entry.get("structured") or entry.get("structured_delegate")))
        for name, entry in by_name.items()
    }


def kernel_name(rule: OpRule) -> str:
    """The name of CUDA's wrapper for `rule`'s overload, as its messages print it."""
    from torchgen.api import dispatcher, native
    from torchgen.model import FunctionSchema

    schema = FunctionSchema.parse(rule.schema)
    if rule.structured:
        return KERNEL_PREFIX + native.name(schema)
    return f"{KERNEL_PREFIX}{schema.name.overload_name}_{dispatcher.name(schema)}"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def bound_arguments(func: torch._ops.OpOverload, args: Sequence[Any],
                    kwargs: dict[str, Any]) -> list[tuple[torch.Argument, Any]]:
    """`func`'s schema arguments paired with the values of this call (defaults skipped)."""
    bound = []
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args) and not argument.kwarg_only:
            bound.append((argument, args[index]))
        elif argument.name in kwargs:
            bound.append((argument, kwargs[argument.name]))
    return bound


def _is_out(argument: torch.Argument) -> bool:
    """An `out=` argument (keyword-only and written)."""
    return argument.kwarg_only and _is_written(argument)


def _is_written(argument: torch.Argument) -> bool:
    """Written by the operator: an `out=` argument or the `self` of an in-place one."""
    return argument.alias_info is not None and argument.alias_info.is_write


def _is_cpu_scalar(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dim() == 0


def _mismatch(first: torch.device, second: torch.device) -> RuntimeError:
    return RuntimeError("Expected all tensors to be on the same device, but found at least "
                        f"two devices, {first} and {second}!")


def check_wrapper(rule: OpRule, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """CUDA's generated-wrapper check: the tensors, in order, all on the first one's device.

    Raises:
        RuntimeError: with CUDA's message naming the first misplaced argument.
    """
    common = None
    for name, tensor in named:
        if common is None:
            common = tensor.device
        elif tensor.device != common:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but got {name} is on "
                f"{tensor.device}, different from other tensors on {common} (when checking "
                f"argument in method {kernel_name(rule)})")


def check_iterator(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   iterator: bool = True) -> None:
    """TensorIterator's check: every operand on the first non-CPU one's device.

    Args:
        outputs: The `out=` (or in-place `self`) tensors.
        inputs: The input tensors; 0-dim CPU ones may join a device computation.
        iterator: False for a structured non-TensorIterator kernel, whose misplaced `out=`
            reads "Expected out tensor to have device …".

    Raises:
        RuntimeError: with CUDA's message.
    """
    operands = [*outputs, *inputs] if iterator else list(inputs)
    common = next((t.device for t in operands if t.device.type != "cpu"), None)
    if common is None:
        common = torch.device("cpu")
    for tensor in inputs:
        if tensor.device != common and not (common.type != "cpu" and _is_cpu_scalar(tensor)):
            raise _mismatch(common, tensor.device)
    for tensor in outputs:
        if tensor.device == common:
            continue
        if iterator:
            raise _mismatch(common, tensor.device)
        raise RuntimeError(f"Expected out tensor to have device {common}, but got "
                           f"{tensor.device} instead")


def _check_indexing(bound: list[tuple[torch.Argument, Any]]) -> None:
    values = {argument.name: value for argument, value in bound}
    target = values.get("self")
    if not isinstance(target, torch.Tensor):
        return
    for index in _tensors(values.get("indices")):
        if index.device != target.device and index.device.type != "cpu":
            raise RuntimeError("indices should be either on cpu or on the same device as the "
                               f"indexed tensor ({target.device})")
    outputs = [value for argument, value in bound if _is_written(argument)
               and isinstance(value, torch.Tensor)]
    source = values.get("values")
    check_iterator(outputs, [target] + ([source] if isinstance(source, torch.Tensor) else []))


def _check_foreach(bound: list[tuple[torch.Argument, Any]]) -> None:
    lists = [value for _, value in bound if isinstance(value, (list, tuple))
             and value and isinstance(value[0], torch.Tensor)]
    shared = [value for _, value in bound if isinstance(value, torch.Tensor)]
    for position in range(len(lists[0]) if lists else 0):
        check_iterator([], [items[position] for items in lists
                            if position < len(items)] + shared)


def check_devices(func: torch._ops.OpOverload, args: Sequence[Any],
                  kwargs: dict[str, Any]) -> None:
    """Raises where CUDA would for this call's tensor placement.

    Args:
        func: The `aten` overload being run (other namespaces get TensorIterator's rule).
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Raises:
        RuntimeError: with the message CUDA gives for the same mix of devices.
    """
    base = func._schema.name.split("::", 1)[-1]
    if base in CROSS_DEVICE or func.namespace in UNCHECKED_NAMESPACES:
        return
    bound = bound_arguments(func, args, kwargs)
    if base in INDEXING:
        _check_indexing(bound)
        return
    if base.startswith("_foreach_"):
        _check_foreach(bound)
        return
    overload = func._schema.overload_name
    rule = (rule_table().get(f"{base}.{overload}" if overload else base)
            if func.namespace == "aten" else None)
    if rule is not None and rule.strict:
        check_wrapper(rule, ((argument.name, tensor)
                             for argument, value in sorted(bound, key=lambda b: not _is_out(b[0]))
                             if _is_out(argument) or not argument.kwarg_only
                             for tensor in _tensors(value)))
        return
    outputs = [tensor for argument, value in bound if _is_written(argument)
               for tensor in _tensors(value)]
    inputs = [tensor for argument, value in bound if not _is_out(argument)
              for tensor in _tensors(value)]
    check_iterator(outputs, inputs, iterator=rule is None or rule.iterator)
