"""Abstract algorithm components. Concrete ones register through the plugin hooks.

Every class carries `name` (what a config selects it by) and `options_class` (an attrs
class validated from the config section of the same name).

Batch fields the algorithms read and write (ragged fields are aligned with
`response_ids`, one value per response token):

* `reward` — `[num_samples]` float, the task reward (after any KL reward penalty);
  `score` keeps the raw task reward when a penalty was applied.
* `rollout_logprobs` — ragged, log-probs the rollout engine reported while sampling.
* `old_logprobs` — ragged, the trainer's log-probs before this step's update (the
  `old_logprob` node); the PPO ratio's denominator. Absent on purely on-policy runs.
* `ref_logprobs` — ragged, the frozen reference model's log-probs (`ref_logprob` node).
* `values` — ragged, the critic's values at sampling time (`values` node).
* `advantages`, `returns` — ragged, written by the advantage estimator.
* `token_rewards` — optional ragged per-token rewards added on top of `reward`
  (read by the token-level estimators `gae` and `reinforce_pp`): a per-token KL penalty,
  a multi-turn trajectory's per-turn rewards (each at its turn's last model token).
  Never non-zero on a token whose `loss_mask` is false.
* `loss_mask` — optional ragged bool: which response tokens are trained. A multi-turn
  trajectory's response interleaves the model's sampled tokens (true) and observation
  tokens (false; their `rollout_logprobs` are 0 by convention). Absent, every response
  token is trained. False tokens add nothing to any loss (policy, KL, entropy, value),
  to its normalisers (`global_tokens`; `global_samples` counts samples with a trained
  token), to the importance weights' and mismatch statistics, to advantage whitening or
  to `response_length/*`; token-level estimators run over the true tokens only (see
  `peerflow.algorithms.advantages`) and every estimator writes advantage 0 on false ones.
  `Batch.loss_mask()` / `Batch.trained_lengths()` read it.
* `is_weights` — ragged, decoupled-PPO importance weights `π_prox / π_behav` (truncated
  or masked, no grad), written before `train_step` (`peerflow.algorithms.off_policy`).
* `train_mask` — optional `[num_samples]` bool: `False` samples (DAPO's overlong
  filtering, dynamic sampling's flat top-up groups, samples the environment or the
  reward failed — `peerflow.algorithms.failed_samples`) are left out of the actor's and
  the critic's loss and of their token and sample normalisers. With `loss_mask` too, a token is
  trained when its sample's `train_mask` and its own `loss_mask` are both true.
* `entropy` — ragged, the current policy's per-token entropy *with grad*; the train
  engine sets it on a micro-batch when the loss's `needs_entropy` is true (entropy bonus).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.engines.base import NoOptions
from peerflow.wirecodec import register


@register  # batches carry examples between ranks (`peerflow.wirecodec`)
@attrs.frozen(kw_only=True)
class Example:
    """One prompt of a task, with what its reward needs to score an answer."""

    prompt: str | list[dict[str, str]]
    """Prompt text, or chat messages (`{role, content}`); the chat template is applied when
    the prompt is encoded."""
    answer: Any = None
    """Reference answer or any metadata the reward reads: plain values (None, bool, int,
    float, str, bytes, lists, dicts), tuples, tensors, numpy values or registered attrs
    classes, which travel between ranks (`peerflow.wirecodec`)."""
    index: int = 0
    """Position in the dataset (stable, used for resumable sampling)."""
    metadata: dict[str, Any] = attrs.field(factory=dict)
    """Other fields of the dataset row (`data_source`, `extra_info`, …), passed to function
    rewards inside their `example` dict."""


def dataset_row(example: Any) -> str:
    """How a message names an example's (or an index's) row: `dataset row N`, from 1."""
    index = example if isinstance(example, int) else getattr(example, "index", None)
    return f"dataset row {index + 1}" if isinstance(index, int) else "dataset row ?"


class _Component:
    name: ClassVar[str]
    options_class: ClassVar[type] = NoOptions

    def __init__(self, options: object | None = None) -> None:
        self.options = options if options is not None else self.options_class()


class RewardFunction(_Component, abc.ABC):
    """Scores decoded answers; runs on the ranks that host the `reward` node."""

    runs_model_code: ClassVar[bool] = False
    """Whether it executes what the model wrote (through `peerflow.sandbox`): then
    `config validate` checks that the run's sandbox can run here."""

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

    uses_token_rewards: ClassVar[bool] = False
    """Whether it reads per-token `token_rewards` (then a KL reward penalty is applied
    per token rather than summed into `reward`)."""

    process_group: Any = None
    """torch.distributed group over which batch-wide statistics (whitening) are reduced;
    `None` reduces over the batch given to `compute` only. `build_algorithm` sets it (the
    worker passes the group of ranks that each hold a share of the step's samples)."""

    group_replicas: int = 1
    """How many ranks of `process_group` hold each dp-shard (tp·pp·… of the advantage
    role's layout); the reduced statistics are divided by it, so replicated shards count
    once and the whitening is global over the dp-ranks."""

    @property
    def compares_within_groups(self) -> bool:
        """Whether an advantage compares the answers to one prompt (GRPO, RLOO).

        Such an estimator needs `rollout.sampling.n >= 2`: with one answer per prompt every
        advantage is 0 (`check_algorithm` refuses the config).
        """
        return False

    @property
    def preferred_aggregation(self) -> str | None:
        """Loss aggregation this estimator's options call for, or `None`.

        Dr.GRPO asks for `seq-mean-token-sum-norm`; `None` keeps the loss's own default.
        """
        return None

    @abc.abstractmethod
    def compute(self, batch: Batch) -> dict[str, RaggedField | torch.Tensor]:
        """Returns new fields, at least `advantages` (ragged, aligned with `response_ids`).

        Reads `reward` (`[num_samples]`) and `group_id`. The batch holds whole groups.
        """


class PolicyLoss(_Component, abc.ABC):
    """A policy-gradient loss; instances satisfy `peerflow.engines.LossFunction`."""

    applies_importance_weights: ClassVar[bool] = False
    """Whether the loss multiplies each token's loss by the batch's `is_weights`
    (decoupled PPO). A run whose samples can be stale refuses a loss that does not."""

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

    def size(self, split: str) -> int | None:
        """Number of examples in `split`, or `None` when the task cannot tell cheaply."""
        return None

    def example(self, split: str, index: int, seed: int) -> Example:
        """Returns example `index` of `split`, as `examples(split, seed)` yields it.

        Tasks override this with a direct lookup; the default walks the iterator.

        Raises:
            IndexError: `index` is past the end of the split.
        """
        for i, example in enumerate(self.examples(split, seed)):
            if i == index:
                return example
        raise IndexError(f"task {self.name!r} split {split!r} has no example {index}.")

    @classmethod
    def check_builder_options(cls, options: Mapping[str, Any]) -> list[str]:
        """Returns the problems with `model.builder_options` for this task's builder.

        Cheap (builds nothing), so a config can be checked before processes start.
        """
        return [
            f"model.builder={cls.name!r}: this task has no model builder; set model.path to "
            "a local Hugging Face model directory, or model.builder to a task that builds "
            "one (reverse-digits, arithmetic)."
        ]

    @classmethod
    def build_model(cls, options: Mapping[str, Any], cache_dir: str | None = None) -> str:
        """Builds (or finds in the cache) a tiny model and tokenizer suited to this task.

        Used by `model.builder: <task name>` when `model.path` is empty.

        Args:
            options: `model.builder_options` from the config.
            cache_dir: Cache root; `None` uses `~/.cache/peerflow/models`.

        Returns:
            The local Hugging Face model directory.
        """
        raise NotImplementedError(
            f"task {cls.name!r} has no model builder; set model.path to a local Hugging "
            "Face model directory, or model.builder to a task that builds one "
            "(reverse-digits, arithmetic)."
        )

    def metadata(self) -> Mapping[str, Any]:
        """Facts a run records about the task (size, generator settings)."""
        return attrs.asdict(self.options) if attrs.has(type(self.options)) else {}
