"""Nested state (an optimiser's `state_dict`) as one safetensors file plus JSON, no pickle.

    save_tree(state, "dir/optim")   # writes dir/optim.safetensors and dir/optim.json
    state = load_tree("dir/optim")  # the same structure back

The JSON holds the structure; every tensor is a leaf `{"tensor": KEY}` whose data is
`KEY` in the safetensors file. Plain JSON covers `None`, booleans, numbers (floats round
trip exactly; `inf` and `nan` as JSON's `Infinity`/`NaN`), strings, lists and dicts with
string keys; a tuple is `{"tuple": [...]}` and a dict with other keys (a torch
optimiser's parameter indices) is `{"items": [[key, value], ...]}`, so `load_tree`
returns exactly the types `save_tree` was given. Anything else (a class instance, a
`torch.dtype`) is refused at save, naming where it sits: loading never runs code.
Both files go through the one atomic writer; the JSON is written second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peerflow.checkpoint.atomic import atomic_path, write_text_atomic

TENSORS = ".safetensors"
STRUCTURE = ".json"
#: The marker keys of the JSON leaves that are not plain JSON.
MARKERS = ("tensor", "tuple", "items")
PLAIN = (type(None), bool, int, float, str)


def _encode(value: Any, where: str, tensors: dict[str, Any], seen: set[int]) -> Any:
    """`value` as JSON, its tensors added to `tensors` (`seen`: their storages so far)."""
    import torch

    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensor = value.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone() if storage in seen else tensor  # no shared memory
        seen.add(storage)
        return {"tensor": key}
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, f"{where}[{i}]", tensors, seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors, seen) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1
                                                            and next(iter(value)) in MARKERS):
            return {k: _encode(v, f"{where}.{k}", tensors, seen) for k, v in value.items()}
        for key in value:
            if not isinstance(key, PLAIN):
                raise TypeError(f"state {where}: key {key!r} ({type(key).__name__}) cannot "
                                "be saved without pickle (keys must be numbers or strings)")
        return {"items": [[k, _encode(v, f"{where}.{k}", tensors, seen)] for k, v in value.items()]}
    raise TypeError(f"state {where} is a {type(value).__name__}, which cannot be saved "
                    "without pickle (tensors, numbers, strings, lists, tuples and dicts can)")


def _decode(value: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and next(iter(value)) in MARKERS:
        kind, body = next(iter(value.items()))
        if kind == "tensor":
            return tensors[body]
        if kind == "tuple":
            return tuple(_decode(v, tensors) for v in body)
        return {k: _decode(v, tensors) for k, v in body}
    return {k: _decode(v, tensors) for k, v in value.items()}


def save_tree(state: Any, stem: str | Path) -> None:
    """Writes `state` as `STEM.safetensors` (its tensors) and `STEM.json` (the rest).

    Raises:
        TypeError: `state` holds something other than tensors, `None`, booleans, numbers,
            strings, lists, tuples and dicts (named by its place in `state`).
    """
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    structure = _encode(state, "state", tensors, set())
    stem = Path(stem)
    with atomic_path(stem.with_name(stem.name + TENSORS)) as tmp:
        save_file(tensors, str(tmp))
    write_text_atomic(stem.with_name(stem.name + STRUCTURE), json.dumps(structure))


def load_tree(stem: str | Path, *, device: str = "cpu") -> Any:
    """Reads what `save_tree(state, stem)` wrote (tensors on `device`)."""
    from safetensors.torch import load_file

    stem = Path(stem)
    tensors = load_file(str(stem.with_name(stem.name + TENSORS)), device=device)
    return _decode(json.loads(stem.with_name(stem.name + STRUCTURE).read_text()), tensors)


def tree_exists(stem: str | Path) -> bool:
    """Whether `save_tree` wrote `stem` (its JSON, written last, is there)."""
    stem = Path(stem)
    return stem.with_name(stem.name + STRUCTURE).is_file()
