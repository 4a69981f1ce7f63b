"""Abstract algorithm components. Concrete ones register through the plugin hooks.

Every class carries `name` (what a config selects it by) and `options_class` (an attrs
class validated from the config section of the same name).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.engines.base import NoOptions


@attrs.frozen(kw_only=True)
class Example:
    """One prompt of a task, with what its reward needs to score an answer."""

    prompt: str
    """Prompt text (chat template not yet applied)."""
    answer: Any = None
    """Reference answer or any metadata the reward reads (must be picklable)."""
    index: int = 0
    """Position in the dataset (stable, used for resumable sampling)."""


class _Component:
    name: ClassVar[str]
    options_class: ClassVar[type] = NoOptions

    def __init__(self, options: object | None = None) -> None:
        self.options = options if options is not None else self.options_class()


class RewardFunction(_Component, abc.ABC):
    """Scores decoded answers; runs on the ranks that host the `reward` node."""

    @abc.abstractmethod
    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Returns one float per response.

        Args:
            responses: Decoded answers (special tokens removed).
            examples: The `Example` each answer responds to.
        """


class AdvantageEstimator(_Component, abc.ABC):
    """Turns rewards (and values) into per-token advantages."""

    needs_values: ClassVar[bool] = False
    """Whether it reads a `values` field from a critic (GAE does)."""

    @abc.abstractmethod
    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns new fields, at least `advantages` (ragged, aligned with
        `response_ids`); reads `reward` (`[num_samples]`) and `group_id`. The batch holds
        whole groups."""


class PolicyLoss(_Component, abc.ABC):
    """A policy-gradient loss; instances satisfy `peerflow.engines.LossFunction`."""

    @abc.abstractmethod
    def __call__(
        self, logprobs: RaggedField, batch: Batch, *, global_tokens: int, global_samples: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """See `peerflow.engines.LossFunction`."""


class Task(_Component, abc.ABC):
    """A dataset of prompts plus the reward that scores answers to them."""

    default_reward: ClassVar[str]
    """Name of the registered reward used when the config names none."""

    @abc.abstractmethod
    def examples(self, split: str, seed: int) -> Iterator[Example]:
        """Yields the examples of `split` (`train` or `eval`) in a deterministic order."""

    def metadata(self) -> Mapping[str, Any]:
        """Facts a run records about the task (size, generator settings)."""
        return attrs.asdict(self.options) if attrs.has(type(self.options)) else {}
