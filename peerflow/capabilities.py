"""What an engine adapter can do. The core branches on these flags, never on names."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Capabilities:
    """Optional abilities an engine adapter declares. Every flag is `False` by default.

    The conformance suite skips a test whose capability is `False` and names the flag in
    the skip reason; the runtime picks code paths from these flags.
    """

    logprobs: bool = False
    """`generate` returns the log-probability of every sampled token."""

    stop_strings: bool = False
    """`SamplingParams.stop` is honoured (generation ends at the first stop string)."""

    tensor_parallel: bool = False
    """The engine shards weights over a `tp` mesh dimension larger than 1."""

    pipeline_parallel: bool = False
    """The engine splits layers over a `pp` mesh dimension larger than 1."""

    expert_parallel: bool = False
    """The engine splits MoE experts over an `ep` mesh dimension larger than 1."""

    shard_load: bool = False
    """`load_weights` accepts the engine's own local shards, so no rank needs full tensors."""

    gathers_full_model: bool = False
    """The engine's API forces a rank to materialise full tensors during a weight sync."""

    in_place_weight_update: bool = False
    """Weights can be replaced while the engine keeps running (no restart)."""

    sleep: bool = False
    """`sleep()` releases accelerator memory (weights, KV cache) and `wake()` restores it."""

    partial_rollout: bool = False
    """`pause()`/`resume()` let weights change mid-request; each token segment keeps its
    weight version."""

    prefix_cache: bool = False
    """The engine caches KV blocks across requests and resets them after a weight sync."""

    value_head: bool = False
    """A train engine that can act as a critic: `forward_values` and value-loss steps."""

    checkpoint: bool = False
    """A train engine that saves and restores model and optimiser state."""

    multiprocess: bool = False
    """The engine runs its model in worker processes of its own (not in the caller's)."""

    gpu_only: bool = False
    """The engine cannot run without a CUDA device."""

    lora: bool = False
    """LoRA adapters (`trainer.lora`): a train engine trains them only (the reference
    policy is its base with adapters off, `weight_sources()` lists the adapter tensors
    only); a rollout engine applies them (`weight_targets()` lists adapter tensors under
    peft's names, and only those move in a weight sync)."""

    def enabled(self) -> list[str]:
        """Returns the names of the flags that are set, in declaration order."""
        return [field.name for field in attrs.fields(type(self)) if getattr(self, field.name)]
