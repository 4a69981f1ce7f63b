"""Strict checkpoint loads: the saved tensors must be exactly the model's tensors.

Every train adapter records the global shape of each tensor it saves and calls
`check_shapes` before copying anything, so a checkpoint of another model (a smaller
hidden size, fewer layers, another head split) is refused instead of loading slices.
Adapters whose shards are their engine's own read their JSON metadata with
`read_engine_meta` and refuse another layout with `check_same_layout`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from peerflow.errors import ConfigError

#: How many names an error lists per kind of difference.
SHOWN = 4


def _names(names: Sequence[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def shape_differences(
    have: Mapping[str, Sequence[int]], want: Mapping[str, Sequence[int]], *,
    have_name: str, want_name: str,
) -> list[str]:
    """How two name → shape maps differ, one phrase per kind of difference (empty: same).

    Args:
        have: The tensors found (name → shape).
        want: The tensors expected (name → shape).
        have_name: What `have` is called beside a shape (`saved`, `weights`).
        want_name: What `want` is called (`model`, `architecture`).

    Returns:
        Up to three phrases, each listing a few names: shapes that differ, names only
        `want` has ("only in the model"), names `want` lacks ("not in the model").
    """
    problems = []
    wrong = [f"{n} {have_name} {list(have[n])}, {want_name} {list(want[n])}"
             for n in sorted(set(have) & set(want)) if list(have[n]) != list(want[n])]
    if wrong:
        problems.append(f"shapes differ: {_names(wrong)}")
    missing = sorted(set(want) - set(have))
    if missing:
        problems.append(f"only in the {want_name}: {_names(missing)}")
    extra = sorted(set(have) - set(want))
    if extra:
        problems.append(f"not in the {want_name}: {_names(extra)}")
    return problems


def check_shapes(
    saved: Mapping[str, Sequence[int]], current: Mapping[str, Sequence[int]], *, where: str
) -> None:
    """Raises unless `saved` and `current` hold the same tensor names with the same shapes.

    Args:
        saved: Tensor name → global shape, as recorded in the checkpoint.
        current: Tensor name → global shape of the model being loaded.
        where: The checkpoint directory (named in the error).

    Raises:
        ConfigError: names or shapes differ; the message lists each difference.
    """
    problems = shape_differences(saved, current, have_name="saved", want_name="model")
    if problems:
        raise ConfigError(
            f"checkpoint {where} was saved from another model ({'; '.join(problems)}). "
            "Resume with the model config the run was started with (RUN_DIR/config.yaml), "
            "or start a fresh run."
        )


def read_engine_meta(directory: str, filename: str, backend: str) -> dict[str, Any]:
    """Reads the JSON metadata a train adapter wrote beside its checkpoint files.

    Raises:
        FileNotFoundError: `directory` holds no such file (not a checkpoint of `backend`).
    """
    path = os.path.join(directory, filename)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{directory} holds no {backend} checkpoint written by PeerFlow ({filename} is "
            "missing); pass the directory save_checkpoint wrote."
        )
    with open(path) as handle:
        return json.load(handle)


def check_same_layout(saved: Mapping[str, int], current: Mapping[str, int], *,
                      where: str) -> None:
    """Raises unless a checkpoint's parallel degrees (e.g. `{"tp": 2, "pp": 1}`) are this run's.

    Raises:
        ConfigError: a degree differs; resuming needs the layout the shards were written with.
    """
    if dict(saved) != dict(current):
        raise ConfigError(
            f"checkpoint {where} was written with {_degrees(saved)} but this run has "
            f"{_degrees(current)}; resume with the same trainer layout."
        )


def _degrees(degrees: Mapping[str, int]) -> str:
    return " ".join(f"{name}={value}" for name, value in degrees.items())
