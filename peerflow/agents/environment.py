"""The environment contract: what a multi-turn agent rollout talks to.

An environment is created once per trajectory from the dataset `Example` the trajectory
answers (a GRPO group of `n` trajectories gets `n` environments, one each). The rollout
driver (`peerflow.agents.rollout`) runs the loop, token in and token out:

1. `Environment(example, options)`; `initial_prompt()` gives the first prompt (default:
   `example.prompt`), chat-templated once into the trajectory's first tokens.
2. Repeatedly: the rollout engine samples the model's turn (`Turn`: its token ids, its
   text, whether it was cut at a length limit); `step(turn)` returns a `StepResult`:
   the observation (text, rendered as the next chat turn(s), or token ids, appended as
   they are), a per-turn reward, and whether the episode is done.
3. `close()` when the trajectory ends (done, a limit, or an error), always.

The trajectory is one growing token sequence: the model's tokens keep the log-probs and
weight versions they were sampled with; observation tokens are appended as tokens and
excluded from the loss (`loss_mask` false); earlier turns are never re-tokenised.

`step` may block (a tool runs) — the driver calls the environments of many trajectories
at once, each under `rollout.agent` time limits, so a slow environment does not stall the
batch. An exception or a time-out from `step` (or `final_reward`) ends that trajectory with
its error marked in the sample (`finish_reason` `"env_error"` or `"env_timeout"`, the text
in `agent_error`); the run goes on, and training leaves the trajectory (by default its
whole group) out as `rollout.agent.on_env_error` says (`peerflow.algorithms.failed_samples`).
`close` runs the same way; its errors are dropped.

Tools are environments too: `peerflow.agents.tools.ToolEnvironment` parses tool calls out
of the model's turn, runs them sandboxed, and returns their results as the observation.

Register an environment class from a plugin:

    @hookimpl
    def peerflow_register_environments(register):
        register(GuessNumber)

and select it with `rollout.agent.environment: guess_number` (its options under
`rollout.agent.options`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from peerflow.algorithms.base import Example
from peerflow.engines.base import NoOptions

if TYPE_CHECKING:
    from peerflow.capabilities import Capabilities
    from peerflow.engines import SamplingParams

Messages = list[dict[str, str]]


@attrs.frozen(kw_only=True)
class Turn:
    """One model turn, as sampled."""

    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    """The sampled token ids of this turn (EOS kept when it ended the turn)."""
    text: str
    """`token_ids` decoded (special tokens skipped)."""
    truncated: bool = False
    """True when the turn hit its token limit instead of ending by itself."""
    index: int = 0
    """Which turn of the trajectory this is (0 for the first)."""
    logprobs: tuple[float, ...] = attrs.field(default=(), converter=tuple)
    """The sampling log-prob of each of `token_ids` (what an OpenAI-compatible endpoint
    returns with `logprobs`)."""
    alternatives: tuple[Turn, ...] = attrs.field(default=(), converter=tuple)
    """The other answers sampled for the same input when `turn_settings()` asked for
    `n > 1` choices (choices 1 … n-1; this turn is choice 0). Each is a sample of its own
    (`finish_reason` `branch`) unless `StepResult.choice` continues the trajectory with it."""


@attrs.frozen(kw_only=True)
class TurnSettings:
    """What an environment asks of the sampler for its next turn.

    Always within the run's `rollout.sampling`: the temperature, top-p and top-k the
    trainer's log-probs assume are never changed per turn.
    """

    n: int = 1
    """Answers to sample for this input (choices; `Turn.alternatives`)."""
    max_tokens: int | None = None
    """Most tokens of the turn (at most `rollout.agent.max_turn_tokens`)."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Stop strings added to the run's (the engine needs `Capabilities.stop_strings`)."""
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    """Token ids that end the turn, added to the run's."""
    seed: int | None = None
    """Seed of the engine call that samples the turn (`None`: the run's)."""


@attrs.frozen(kw_only=True)
class StepResult:
    """What an environment answers to one model turn."""

    observation: str | Messages | Sequence[int] = ""
    """The next input to the model: text (sent as one message of `role`), chat messages
    (`{role, content}`; rendered with the chat template as a continuation, without
    re-rendering earlier turns), or token ids (appended exactly as given). Empty when
    `done`."""
    role: str = "user"
    """Chat role of a text observation (`user`, or `tool` for tool results)."""
    reward: float = 0.0
    """Reward for this turn (added to the trajectory's per-turn rewards)."""
    done: bool = False
    """True when the episode is over; the driver then calls `close()`."""
    info: dict[str, Any] = attrs.field(factory=dict)
    """Anything worth logging (numbers become metrics `agent/<key>`)."""
    restart: Sequence[int] | None = None
    """Token ids of a new first prompt: the trajectory so far ends as a sample of its own
    (`finish_reason` `restart`) and the episode goes on as a new sample of the same group
    from these ids (its `agent_info` has `segment`: 1, 2, …). For inputs that do not
    extend the sequence (the policy endpoint's calls that rewrite an earlier turn)."""
    choice: int = 0
    """Which answer the trajectory continues with: 0 for `turn`, k for
    `turn.alternatives[k - 1]` (an agent that sampled `n` choices and went on with one)."""


class Environment(abc.ABC):
    """One episode of an interactive task; subclass it and register the class."""

    name: ClassVar[str]
    """What `rollout.agent.environment` selects this environment by."""
    options_class: ClassVar[type] = NoOptions
    """attrs class for `rollout.agent.options`, validated before any worker starts."""
    runs_model_code: ClassVar[bool] = False
    """Whether its episodes execute what the model wrote (through `peerflow.sandbox`):
    then `config validate` checks that the run's sandbox can run here."""
    scores_environment_rewards: ClassVar[bool] = False
    """Whether its episodes score the task's rewards written TRL's way,
    `reward_func(environments, **kwargs)` (`peerflow.rewards.trl_style`): the driver hands
    them to `adopt_rewards` and the reward pool never calls them. Without it such a reward
    is refused at validate."""

    def __init__(self, example: Example, options: Any) -> None:
        self.example = example
        self.options = options

    def initial_prompt(self) -> str | Messages:
        """Returns the first prompt of the episode (default: the example's prompt)."""
        return self.example.prompt

    def initial_prompt_ids(self, tokenizer: Any) -> list[int] | None:
        """Returns the first prompt as token ids, or `None` to render `initial_prompt()`.

        For environments whose first prompt arrives already tokenised (the policy
        endpoint's calls, `peerflow.agents.endpoint`): the ids are used exactly as given.

        Args:
            tokenizer: The model's tokenizer.
        """
        return None

    def prepare(self, sampling: SamplingParams, capabilities: Capabilities) -> None:
        """Called once before the first prompt (default: nothing).

        Args:
            sampling: The run's sampling settings.
            capabilities: The rollout engine's, for environments that check per-turn
                requests against them (`turn_settings`).
        """
        return None

    def turn_settings(self) -> TurnSettings:
        """Returns what the next turn asks of the sampler (default: the run's settings)."""
        return TurnSettings()

    def tool_schemas(self) -> list[dict[str, Any]]:
        """Returns the JSON schemas of the tools the model may call (default: none).

        The driver renders the first prompt with them (`peerflow.agents.tools.render_prompt`:
        the chat template's `tools=` argument where the template uses it, else a tool
        description in the system message).
        """
        return []

    @abc.abstractmethod
    def step(self, turn: Turn) -> StepResult:
        """Answers the model's turn.

        Args:
            turn: The model's turn, as sampled.

        Returns:
            The observation, this turn's reward and whether the episode is done.

        Raise only for the environment's own failures (they end the trajectory as
        `env_error`, which training leaves out by default); end an episode the model
        ruined with `done=True`, so it is scored and trained on.
        """

    def final_reward(self) -> float | dict[str, float] | None:
        """Returns the episode's outcome reward, or `None` to let the task's reward score it.

        A dict of named rewards (a rubric's parts) is summed into the outcome; each also
        becomes a reward component (`reward/<name>/mean`, shown in `peerflow samples`).

        Called once after the last turn. The default sums nothing and defers to the task's
        reward functions (which see the whole trajectory's text).
        """
        return None

    def adopt_rewards(self, rewards: Sequence[Any]) -> None:
        """Takes the task's `environments` rewards (`peerflow.rewards.setup.EpisodeReward`).

        Called once, before the first prompt, on environments that declare
        `scores_environment_rewards`; `final_reward` then returns their scores of the
        episode (default: nothing).

        Args:
            rewards: Each with `name`, `weight` and the loaded `function`.
        """
        return None

    def turn_failed(self, error: str) -> None:
        """Called when the driver ends the episode before its turn (default: nothing).

        The engine could not sample the turn (the driver retried the prompt alone and it
        failed again), or the episode's group cannot start (its first prompts differ, or
        do not fit the model's context: `peerflow.agents.first_prompts`). The trajectory
        ends as `env_error` (`error` is its `agent_error`); the other episodes go on.

        Args:
            error: What the engine raised.
        """
        return None

    def close(self) -> None:
        """Releases what the episode holds (sandboxes, files); called exactly once."""
        return None
