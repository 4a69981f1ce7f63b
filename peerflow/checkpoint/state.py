"""Process state a checkpoint carries besides the engines: RNG states, metrics to re-run."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import cattrs
import torch

from peerflow.checkpoint.atomic import write_text_atomic

#: Lets a validator's own error (e.g. `ConfigError`) through, not wrapped in a group.
_CONVERTER = cattrs.Converter(detailed_validation=False)


class JsonState:
    """Mixin of an attrs class whose fields are its whole checkpointed state.

    `state_dict()` is JSON-ready (int dict keys become strings in JSON);
    `from_state_dict()` rebuilds the instance, keys and values converted to the field
    types and the class's validators run (`cattrs`).
    """

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, for checkpoints of the in-flight work."""
        return _CONVERTER.unstructure(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Any:
        """Rebuilds an instance from `state_dict()`'s output (also after a JSON round trip)."""
        return _CONVERTER.structure(state, cls)


def rng_state() -> dict[str, Any]:
    """Returns the process's Python and torch CPU RNG states as JSON-ready data."""
    torch_state = torch.get_rng_state().numpy().tobytes()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch_state).decode(),
        "python": [py_version, list(py_state), py_gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores `rng_state()` output."""
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))


def truncate_metrics(path: str | Path, last_step: int) -> None:
    """Drops `metrics.jsonl` lines past `last_step` (steps re-run after a resume)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= last_step:
                kept.append(line)
        except (ValueError, AttributeError):
            continue
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))
