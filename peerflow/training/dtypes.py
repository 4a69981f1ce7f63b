"""Parameter dtype names (`EngineContext.dtype`) to torch dtypes."""

from __future__ import annotations

import torch

from peerflow.errors import ConfigError

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """The torch floating-point dtype called `name`.

    Raises:
        ConfigError: `name` is not one of float32, bfloat16, float16.
    """
    if name not in _FLOAT_DTYPES:
        raise ConfigError(
            f"EngineContext.dtype={name!r} is not a training dtype; use one of "
            f"{', '.join(_FLOAT_DTYPES)} (model.dtype in the config)."
        )
    return getattr(torch, name)
