"""The conformance hooks: the one list of the optional classmethods the suite reads.

An adapter never imports `peerflow.conformance`; it declares itself to the suite through
its registry entry and these classmethods on the engine class, all optional. The table in
docs/conformance.md ("Conformance hooks") is `hook_table()` (a test keeps them equal),
and `AdapterProfile.hook` refuses a name that is not listed here, so a hook cannot be
read without being documented.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class ConformanceHook:
    """One optional classmethod of an engine class that the suite reads."""

    name: str
    signature: str
    """Its arguments, as authors write them (`(engine)`)."""
    returns: str
    """What it returns (Markdown)."""
    default: str
    """What the suite does without it (Markdown)."""


#: Every hook the suite reads, in the order the docs list them.
HOOKS: tuple[ConformanceHook, ...] = (
    ConformanceHook(
        name="shard_layout", signature='(hf_config, layout, rank, dtype="float32")',
        returns="`list[ShardSpec]` as `weight_targets()`/`weight_sources()` on that rank, "
                "a pure function (no engine built); `ConfigError` for refused layouts",
        default="none: layers 1–2 skip"),
    ConformanceHook(
        name="conformance_layouts", signature="()",
        returns="`list[ParallelLayout]` to test",
        default="`DEFAULT_LAYOUTS` (single, tp2, tp4, pp2, tp2×pp2, dp2)"),
    ConformanceHook(
        name="conformance_families", signature="()",
        returns="`tuple[str, ...]` of HF `model_type`s supported (see below)",
        default="all"),
    ConformanceHook(
        name="conformance_xfail", signature="()",
        returns="`{test name or fnmatch pattern: reason}`, strict (an unexpected pass fails)",
        default="none"),
    ConformanceHook(
        name="conformance_engine", signature="(model_path, *, device)",
        returns="a built one-rank engine (for engines needing env vars, extra options)",
        default="`cls(EngineContext(...), cls.options_class())` (train engines also get "
                "`OptimSettings(bf16=False, padding_free=False)` and a one-process gloo "
                "group)"),
    ConformanceHook(
        name="conformance_read_weights", signature="(engine)",
        returns="`{local_name: tensor}` read by a path that bypasses the adapter's "
                "`load_weights`/`materialize` (live tensors or copies)",
        default="none: bit-exact tests skip"),
    ConformanceHook(
        name="conformance_scribble", signature="(engine)",
        returns="overwrites every weight in the engine",
        default="fills `conformance_read_weights` tensors with a constant"),
    ConformanceHook(
        name="conformance_read_adapters", signature="(engine)",
        returns="LoRA adapter tensors under peft's names",
        default="adapter tensors of `conformance_read_weights`"),
)

#: The hooks by name.
HOOK_NAMES = frozenset(hook.name for hook in HOOKS)


def hook_table() -> str:
    """The Markdown table of every hook (docs/conformance.md holds it verbatim)."""
    rows = ["| hook | returns | default |", "|---|---|---|"]
    rows += [f"| `{h.name}{h.signature}` | {h.returns} | {h.default} |" for h in HOOKS]
    return "\n".join(rows) + "\n"
