"""What the suite reads from an adapter class: its kind and its optional conformance hooks.

An adapter never imports `peerflow.conformance`. It declares itself to the suite through
its registry entry (`peerflow_register_rollout_engines` / `…_train_engines`) and optional
classmethods on the engine class, all with defaults: the one list of them, with what each
returns, is `peerflow.conformance.hooks.HOOKS` (docs/conformance.md, "Conformance hooks").
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable
from typing import Any

import attrs

from peerflow.conformance.hooks import HOOK_NAMES
from peerflow.engines import RolloutEngine, TrainEngine
from peerflow.layout import ParallelLayout

#: Layouts tested when the adapter does not list its own.
DEFAULT_LAYOUTS = (
    ParallelLayout(),
    ParallelLayout(tp=2),
    ParallelLayout(tp=4),
    ParallelLayout(pp=2),
    ParallelLayout(tp=2, pp=2),
    ParallelLayout(dp=2),
)

#: Capability a layout needs, per mesh dimension larger than 1.
LAYOUT_CAPABILITIES = {"tp": "tensor_parallel", "pp": "pipeline_parallel",
                       "ep": "expert_parallel"}


def layout_id(layout: ParallelLayout) -> str:
    """Returns a short test id for a layout, e.g. `tp2pp2` or `single`."""
    parts = [f"{d}{getattr(layout, d)}" for d in ("dp", "tp", "pp", "ep") if getattr(layout, d) > 1]
    return "".join(parts) or "single"


@attrs.frozen(kw_only=True)
class AdapterProfile:
    """An adapter class as the suite sees it."""

    cls: type
    """The engine class."""
    kind: str
    """`rollout` or `train`."""

    @classmethod
    def of(cls, engine_class: type) -> AdapterProfile:
        """Classifies `engine_class`.

        Raises:
            TypeError: it subclasses neither `RolloutEngine` nor `TrainEngine`.
        """
        if inspect.isclass(engine_class) and issubclass(engine_class, RolloutEngine):
            return cls(cls=engine_class, kind="rollout")
        if inspect.isclass(engine_class) and issubclass(engine_class, TrainEngine):
            return cls(cls=engine_class, kind="train")
        raise TypeError(f"{engine_class!r} is neither a peerflow.RolloutEngine nor a "
                        "peerflow.TrainEngine subclass; the suite tests engine adapters.")

    @property
    def name(self) -> str:
        """Registry name."""
        return getattr(self.cls, "name", self.cls.__name__)

    def hook(self, name: str) -> Callable[..., Any] | None:
        """Returns the adapter's classmethod `name`, or `None` when it has none.

        Raises:
            KeyError: `name` is not a listed hook (`peerflow.conformance.hooks.HOOKS`):
                every hook the suite reads is documented there.
        """
        if name not in HOOK_NAMES:
            raise KeyError(f"{name!r} is not a conformance hook; list it in "
                           "peerflow.conformance.hooks.HOOKS (and docs/conformance.md)")
        return getattr(self.cls, name, None)

    def shard_layout(self, hf_config: Any, layout: ParallelLayout, rank: int,
                     dtype: str = "float32") -> list:
        """Calls the adapter's `shard_layout`, passing `dtype` when the hook accepts it."""
        hook = self.hook("shard_layout")
        if "dtype" in inspect.signature(hook).parameters:
            return hook(hf_config, layout, rank, dtype=dtype)
        return hook(hf_config, layout, rank)

    def layouts(self) -> tuple[ParallelLayout, ...]:
        """Layouts to test."""
        hook = self.hook("conformance_layouts")
        return tuple(hook()) if hook else DEFAULT_LAYOUTS

    def families(self) -> tuple[str, ...] | None:
        """Supported HF model types, or `None` for all."""
        hook = self.hook("conformance_families")
        return tuple(hook()) if hook else None

    def xfails(self) -> dict[str, str]:
        """Expected failures: test-name pattern → reason."""
        hook = self.hook("conformance_xfail")
        return dict(hook()) if hook else {}

    def xfail_reason(self, nodeid: str, test_name: str) -> str | None:
        """Returns the expected-failure reason of a test, if declared."""
        for pattern, reason in self.xfails().items():
            if pattern == test_name or fnmatch.fnmatchcase(nodeid, pattern) or \
                    fnmatch.fnmatchcase(test_name, pattern):
                return reason
        return None

    def missing_capability(self, layout: ParallelLayout) -> str | None:
        """Returns the capability a layout needs and the adapter lacks, if any."""
        for dim, flag in LAYOUT_CAPABILITIES.items():
            if getattr(layout, dim) > 1 and not getattr(self.cls.capabilities, flag):
                return flag
        return None
