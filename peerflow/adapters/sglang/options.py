"""Options of the `sglang` rollout engine (`rollout.sglang: {...}` in a run config)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class SGLangRolloutOptions:
    """Options of the `sglang` rollout engine; `engine_args` reaches `sglang.Engine`."""

    tp_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """SGLang tensor-parallel degree; SGLang drives its tp scheduler processes itself
    from the rank that hosts the engine (`Capabilities.multiprocess`)."""
    mem_fraction_static: float = attrs.field(
        default=0.5, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)]
    )
    """Share of GPU memory for weights and KV cache (leave room for a colocated trainer)."""
    enable_memory_saver: bool = True
    """Start SGLang with its memory saver so `sleep()`/`wake()`
    (`release_memory_occupation`/`resume_memory_occupation`) free and restore memory."""
    disable_radix_cache: bool = False
    """Turn off SGLang's prefix (radix) cache; it is flushed after every sync otherwise."""
    max_running_requests: int | None = None
    """Most requests SGLang runs at once; `None` lets SGLang decide."""
    context_length: int | None = None
    """Longest prompt + answer in tokens; `None` takes the model config's value."""
    include_stop_str_in_output: bool = False
    """Keep the tokens that spell a matched stop string (SGLang's `no_stop_trim`)."""
    engine_args: dict[str, Any] = attrs.field(factory=dict)
    """Extra keyword arguments for `sglang.Engine` (its `ServerArgs` fields)."""
