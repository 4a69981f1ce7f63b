"""Episodes whose environment owns tools and rewards: OpenEnv servers and TRL-style classes.

`ToolEpisode` is the loop both share, token in and token out through the one agent driver
(`peerflow.agents.rollout`): the environment's tools are rendered into the first prompt
(`tool_schemas`), each `<tool_call>` the model writes (`peerflow.agents.tool_calls`) runs
through `call_tool` and its result comes back as a `tool` message (an observation: tokens
appended, masked out of the loss). A turn without a call is the model's answer: it ends
the episode, or, with `answer_tool` set, is passed to that tool as
`{answer_argument: text}` and the environment decides whether the episode goes on (a
multi-turn game that takes the answer as its move). Rewards the environment returns (an
OpenEnv observation's `reward`, a TRL class's `get_reward()`) are the outcome, as the named
reward `reward_name`: a reward component (`reward/<name>/mean`) like a reward file's.

`EnvironmentFactory` (`rollout.agent.environment: environment-factory`) runs the classes
written for TRL's `GRPOTrainer(environment_factory=Cls)` in process: one instance per
trajectory, `reset(**example)` (its keyword arguments picked from the example's fields; a
returned string is appended to the prompt), every public method with a Google-style
docstring (`Args:`) is a tool (its schema from the signature and docstring, as TRL and
transformers build it). The reward is read as TRL reads it, the first of: the task's
rewards written TRL's way, `reward_func(environments, **kwargs)` (`task.reward`; each
episode calls them on its own instance, `environments=[instance]`, in the rollout
process); `get_reward()`; a numeric `reward` attribute. PeerFlow's one addition: an
instance whose `done` attribute is true after a call ends the episode (a game the answer
tool finished).
"""

from __future__ import annotations

import abc
import inspect
import json
from typing import Any, ClassVar

import attrs

from peerflow.agents.environment import Environment, Messages, StepResult, Turn
from peerflow.agents.tool_calls import parse_tool_calls
from peerflow.agents.tool_env import prompt_messages, tool_message
from peerflow.algorithms.base import Example


@attrs.frozen(kw_only=True)
class ToolEpisodeOptions:
    """`rollout.agent.options` every tool episode has."""

    system_prompt: str = ""
    """A system message before the example's prompt (empty: none)."""
    answer_tool: str = ""
    """A tool that receives a turn without a call (`{answer_argument: text}`); empty: such a
    turn is the answer and ends the episode."""
    answer_argument: str = "answer"
    """The argument of `answer_tool` that gets the turn's text."""
    reward_name: str = "env"
    """The reward component the environment's rewards are summed into."""
    max_calls_per_turn: int = attrs.field(default=4, validator=attrs.validators.gt(0))
    """Calls run per turn; further calls get an error result."""
    max_result_chars: int = attrs.field(default=2000, validator=attrs.validators.gt(0))
    """A result longer than this is cut (and says so)."""


@attrs.frozen(kw_only=True)
class ToolAnswer:
    """What the environment answered to one tool call."""

    text: str
    """The result the model sees."""
    reward: float | None = None
    """The reward the environment gave for it (`None`: none)."""
    done: bool = False
    """Whether the environment ended the episode."""
    error: bool = False
    """Whether the call failed (the model sees `Error: …`)."""


class ToolEpisode(Environment):
    """One episode of an environment that owns tools (`call_tool`) and rewards."""

    options_class: ClassVar[type] = ToolEpisodeOptions

    def __init__(self, example: Example, options: Any) -> None:
        super().__init__(example, options)
        self.rewards: list[float] = []
        """Every reward the environment gave, in order."""
        self.opening = ""
        """Text the environment adds to the first prompt (its reset observation)."""

    @abc.abstractmethod
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The environment's tools as chat-template function schemas."""

    @abc.abstractmethod
    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolAnswer:
        """Runs one call in the environment.

        Args:
            name: The tool the model called.
            arguments: Its arguments, as the model wrote them.
        """

    def initial_prompt(self) -> str | Messages:
        """The example's prompt (after `system_prompt`), then the environment's opening."""
        prompt = self.example.prompt
        if self.opening:
            prompt = [*prompt_messages(prompt, ""), {"role": "user", "content": self.opening}]
        return prompt_messages(prompt, self.options.system_prompt)

    def step(self, turn: Turn) -> StepResult:
        """Runs the turn's calls (or passes the answer to `answer_tool`)."""
        calls = parse_tool_calls(turn.text)
        if not calls and not self.options.answer_tool:
            return StepResult(done=True, info={"tool_calls": 0})
        if not calls:
            answer = self._call(self.options.answer_tool,
                                {self.options.answer_argument: turn.text.strip()})
            return StepResult(observation="" if answer.done else answer.text, done=answer.done,
                              info={"tool_calls": 0, "tool_errors": int(answer.error)})
        answers = []
        for index, call in enumerate(calls):
            if call.error:
                answers.append(ToolAnswer(text=call.error, error=True))
            elif index >= self.options.max_calls_per_turn:
                answers.append(ToolAnswer(text=f"at most {self.options.max_calls_per_turn} "
                                          "tool calls run per turn", error=True))
            else:
                answers.append(self._call(call.name, call.arguments))
        info = {"tool_calls": len(calls), "tool_errors": sum(a.error for a in answers)}
        if any(a.done for a in answers):
            return StepResult(done=True, info=info)
        return StepResult(observation=[self._message(a) for a in answers], info=info)

    def _call(self, name: str, arguments: dict[str, Any]) -> ToolAnswer:
        answer = self.call_tool(name, arguments)
        if answer.reward is not None:
            self.rewards.append(float(answer.reward))
        return answer

    def _message(self, answer: ToolAnswer) -> dict[str, str]:
        return tool_message(answer.text, answer.error, self.options.max_result_chars)

    def final_reward(self) -> dict[str, float] | None:
        """The environment's rewards summed as `reward_name`; `None` when it gave none."""
        if not self.rewards:
            return None
        return {self.options.reward_name: sum(self.rewards)}


def _loadable_class(_: object, attribute: attrs.Attribute, value: str) -> None:
    load_target(value, f"rollout.agent.options.{attribute.name}")


def load_target(value: str, key: str) -> Any:
    """The object `path/to/file.py:Name` or `package.module:Name` names."""
    from peerflow.rewards.loading import load_function, parse_target

    target = parse_target(value)
    if target is None:
        raise ValueError(f"{key}={value!r}: name it as path/to/file.py:Name or "
                         "package.module:Name.")
    return load_function(target, key)


@attrs.frozen(kw_only=True)
class FactoryOptions(ToolEpisodeOptions):
    """`rollout.agent.options` of `environment-factory`."""

    factory: str = attrs.field(validator=_loadable_class)
    """The class (TRL's `environment_factory`): `path/to/env.py:Cls` or `module:Cls`."""
    reward_name: str = ""
    """The reward component `get_reward()` or the `reward` attribute is reported as
    (empty: `get_reward` or `reward`, what was read); rewards of `task.reward` keep their
    own names."""


def method_tools(instance: Any) -> dict[str, Any]:
    """The public methods of `instance` that are tools: those with an `Args:` docstring.

    `reset` and `get_reward` are not tools; a method without arguments is one when its
    docstring has a summary (TRL's rule: public methods, documented).
    """
    tools = {}
    for name, member in inspect.getmembers(type(instance), inspect.isfunction):
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        doc = inspect.getdoc(member) or ""
        takes_args = len(inspect.signature(member).parameters) > 1
        if doc and ("Args:" in doc or not takes_args):
            tools[name] = getattr(instance, name)
    return tools


def _schema(method: Any) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(method)
    except Exception as exc:  # noqa: BLE001 — transformers says what is missing
        raise ValueError(f"tool {method.__name__!r} of the environment_factory class: "
                         f"{exc} (document each argument under Args: and type-hint it).") from exc


class EnvironmentFactory(ToolEpisode):
    """A TRL-style `environment_factory` class, one instance per trajectory, in process."""

    name: ClassVar[str] = "environment-factory"
    options_class: ClassVar[type] = FactoryOptions
    scores_environment_rewards: ClassVar[bool] = True

    def __init__(self, example: Example, options: FactoryOptions) -> None:
        super().__init__(example, options)
        self.task_rewards: list[Any] = []
        """The task's `reward_func(environments)` rewards (`adopt_rewards`)."""
        self.answers: list[str] = []
        """The model's turns, as the rewards' `completions`."""
        from peerflow.rewards.scoring import example_record

        cls = load_target(options.factory, "rollout.agent.options.factory")
        self.env = cls()
        reset = getattr(self.env, "reset", None)
        if reset is not None:
            record = example_record(example)
            params = inspect.signature(reset).parameters
            takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
            opening = reset(**{k: v for k, v in record.items() if takes_all or k in params})
            self.opening = opening if isinstance(opening, str) else ""
        self.tools = method_tools(self.env)
        self.schemas = [_schema(method) for method in self.tools.values()]

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The class's documented public methods, as function schemas."""
        return self.schemas

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolAnswer:
        """Calls the method; what it raises is the model's error message."""
        method = self.tools.get(name)
        if method is None:
            return ToolAnswer(text=f"there is no tool {name!r}; the tools are "
                              f"{sorted(self.tools)}", error=True)
        try:
            value = method(**arguments)
        except Exception as exc:  # noqa: BLE001 — shown to the model, the episode goes on
            return ToolAnswer(text=f"{type(exc).__name__}: {exc}", error=True)
        return ToolAnswer(text=value if isinstance(value, str) else json.dumps(value),
                          done=bool(getattr(self.env, "done", False)))

    def adopt_rewards(self, rewards: Any) -> None:
        """Keeps the task's `reward_func(environments)` rewards; they score the episode."""
        self.task_rewards = list(rewards)

    def step(self, turn: Turn) -> StepResult:
        """Keeps the turn's text (the rewards' `completions`), then runs its calls."""
        self.answers.append(turn.text)
        return super().step(turn)

    def final_reward(self) -> dict[str, float] | None:
        """The episode's reward as TRL reads it (see the module docstring).

        Returns:
            Named rewards: each task reward's weighted score of this instance, else
            `get_reward()` or the numeric `reward` attribute as `reward_name`; `None`
            (the task's other rewards score it) when the class defines none.
        """
        if self.task_rewards:
            return {r.name: r.weight * self._score(r.function) for r in self.task_rewards}
        get_reward = getattr(self.env, "get_reward", None)
        if callable(get_reward):
            return {self.options.reward_name or "get_reward": float(get_reward())}
        reward = getattr(self.env, "reward", None)
        if isinstance(reward, int | float) and not isinstance(reward, bool):
            return {self.options.reward_name or "reward": float(reward)}
        return super().final_reward()

    def _score(self, function: Any) -> float:
        """Calls a TRL reward on this episode: `environments=[instance]`, one completion."""
        import asyncio

        from peerflow.rewards.scoring import example_record
        from peerflow.rewards.trl_style import ENVIRONMENTS, call_trl

        values, _ = call_trl(function, ["".join(self.answers)], [example_record(self.example)],
                             {ENVIRONMENTS: [self.env]})
        if inspect.isawaitable(values):
            values = asyncio.run(values)
        value = list(values)[0]
        return 0.0 if value is None else float(value)
