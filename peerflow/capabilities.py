"""What an engine adapter can do. The core branches on these flags, never on names.

`Capabilities` is the one declaration: the runtime and `peerflow config validate` read
the flags (a setting that needs a flag the selected engine lacks is refused before any
process starts, naming the setting, the reason and the fix: `peerflow.config.refusals`),
and the conformance suite skips a test whose flag is `False`, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


def _check_reasons(instance: Capabilities, _: attrs.Attribute, value: Mapping[str, str]
                   ) -> None:
    flags = instance.flags()
    for name, reason in value.items():
        if name not in flags:
            raise ValueError(f"Capabilities(reasons={{{name!r}: …}}): {name!r} is no "
                             f"capability; use one of {', '.join(flags)}.")
        if getattr(instance, name):
            raise ValueError(f"Capabilities(reasons={{{name!r}: …}}): {name} is declared "
                             "True; a reason is only for a capability the engine lacks.")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"Capabilities(reasons={{{name!r}: {reason!r}}}): the reason "
                             "must be a non-empty sentence saying why.")


@attrs.frozen(kw_only=True)
class Capabilities:
    """Optional abilities an engine adapter declares. Every flag is `False` by default.

    Each flag is read by the runtime (`config validate` refuses a setting that needs a
    flag the engine lacks; colocated placement calls `sleep`, …) or by the conformance
    suite (a test whose flag is `False` is skipped, naming it). `reasons` says why an
    engine lacks a flag users may ask for; `config validate` quotes it.

    Example:
        `Capabilities(tensor_parallel=True, reasons={"lora": "megatron-core has no LoRA"})`
    """

    logprobs: bool = False
    """`generate` returns the log-probability of every sampled token (conformance)."""

    stop_strings: bool = False
    """`SamplingParams.stop` is honoured (generation ends at the first stop string);
    without it `rollout.sampling.stop` is refused at `config validate`."""

    tensor_parallel: bool = False
    """The engine shards weights over a `tp` mesh dimension larger than 1 (without it,
    `<side>.layout.tp > 1` is refused at `config validate`)."""

    pipeline_parallel: bool = False
    """The engine splits layers over a `pp` mesh dimension larger than 1 (`layout.pp`)."""

    expert_parallel: bool = False
    """The engine splits MoE experts over an `ep` mesh dimension larger than 1 (`layout.ep`)."""

    in_place_weight_update: bool = False
    """Weights can be replaced while the engine keeps running (no restart; conformance)."""

    sleep: bool = False
    """`sleep()` releases accelerator memory (weights, KV cache) and `wake()` restores it;
    colocated placement calls them around generation."""

    partial_rollout: bool = False
    """`pause()`/`resume()` let weights change mid-request; each token segment keeps its
    weight version (`runtime.partial_rollout` chunks requests on engines without it)."""

    value_head: bool = False
    """A train engine that can act as a critic: `forward_values` and value-loss steps
    (a workflow with a `critic` role needs it)."""

    checkpoint: bool = False
    """A train engine that saves and restores model and optimiser state."""

    multiprocess: bool = False
    """The engine runs its model in worker processes of its own (not in the caller's) and
    drives its own tensor parallelism from one rank per replica: its tp degree is one of
    its options, and `rollout.layout.tp`/`pp` above 1 are refused at `config validate`."""

    gpu_only: bool = False
    """The engine cannot run without a CUDA device."""

    lora: bool = False
    """LoRA adapters (`trainer.lora`): a train engine trains them only (the reference
    policy is its base with adapters off, `weight_sources()` lists the adapter tensors
    only); a rollout engine applies them (`weight_targets()` lists adapter tensors under
    peft's names, and only those move in a weight sync)."""

    padding_free: bool = False
    """A train engine that runs padding-free micro-batches (`trainer.padding_free: true`;
    `auto` pads on engines without it)."""

    activation_checkpointing: bool = False
    """A train engine that recomputes each block's activations in backward
    (`trainer.activation_checkpointing: true`)."""

    routed_experts: bool = False
    """A rollout engine that returns the experts a mixture-of-experts model routed every
    token to (`GenerationResult.routed_experts`); `trainer.routing_replay: r3` needs it
    (docs/moe.md)."""

    routing_replay: bool = False
    """A train engine whose MoE routers run under the toolkit's routing-replay controller
    (`trainer.routing_replay: r2 | r3`; `CausalLMTrainEngine.attach_routing`)."""

    reasons: Mapping[str, str] = attrs.field(
        factory=dict, converter=dict, validator=_check_reasons, eq=False,
        hash=False)
    """Why the engine lacks a capability users may ask for, by flag name
    (`{"lora": "…"}`); quoted by `config validate` when a setting needs it. Only flags
    that are `False` may have one."""

    @classmethod
    def flags(cls) -> list[str]:
        """Returns the names of every flag (the boolean fields), in declaration order."""
        return [field.name for field in attrs.fields(cls) if field.name != "reasons"]

    def enabled(self) -> list[str]:
        """Returns the names of the flags that are set, in declaration order."""
        return [name for name in self.flags() if getattr(self, name)]
