"""verifiers v0 environments (verifiers 0.3.x), run in process against the policy endpoint.

`task.name: verifiers` with `task.options.environment` (an installed environment module
that defines `load_environment`, as `vf.load_environment` loads it, or
`path/to/env.py:load_environment` / `module:function`) and `env_args`: example `i` of the
train split is row `i` of the environment's `get_dataset()`, of the eval split row `i` of
`get_eval_dataset()` (the train rows when it has none); the prompt is the row's, as the
environment formatted it (system prompt, few-shot).

`rollout.agent.environment: verifiers` runs each trajectory as the environment's own
`rollout` — `SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`, any v0 `Environment` — and its
`Rubric`, with an `AsyncOpenAI` client pointed at the episode's `base_url` on the policy
endpoint: it is an agent program (`peerflow.agents.endpoint.program`), so every call is
recorded token-exactly and the time limits, sync and async mode apply as there. The
rubric's scores flow back as named rewards: each reward function with a non-zero weight
is a reward component (`reward/<function>/mean`, its weighted score; their sum is the
outcome, the rubric's `reward`), and every function's raw score is a metric
(`agent/verifiers/<function>`).

`score_rollout` scores each episode alone; rubrics with group reward functions (which
compare the rollouts of a group) are refused when the episode is scored.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs

from peerflow.agents.endpoint.program import AgentProgram, AgentProgramOptions
from peerflow.agents.environment import StepResult, Turn
from peerflow.algorithms.base import Example, Task
from peerflow.contrib.ecosystem.tool_episodes import load_target

MODULE, EXTRA = "verifiers", "verifiers"
META_KEY = "verifiers"
INSTALL_HINT = ("pip install 'peerflow[verifiers]' && pip install --no-deps verifiers==0.3.1 "
                "openai-agents==0.24.0 (scripts/install-cpu.sh does both; "
                "docs/environments.md says why)")
_ENVS: dict[str, Any] = {}
_LOCK = threading.Lock()


def load_vf_environment(environment: str, env_args: dict[str, Any]) -> Any:
    """The verifiers environment `environment` names, loaded once per process."""
    import json

    key = json.dumps([environment, env_args], sort_keys=True, default=str)
    with _LOCK:
        if key not in _ENVS:
            if ":" in environment:
                env = load_target(environment, "task.options.environment")(**env_args)
            else:
                import verifiers as vf

                env = vf.load_environment(environment, **env_args)
            _ENVS[key] = env
        return _ENVS[key]


def _rows(env: Any, split: str) -> Any:
    eval_rows = env.get_eval_dataset() if split == "eval" and env.eval_dataset is not None \
        else None
    return eval_rows if eval_rows is not None else env.get_dataset()


def _loadable(_: object, attribute: attrs.Attribute, value: str) -> None:
    import importlib.util

    if importlib.util.find_spec(MODULE) is None:
        return  # config validate names the missing extra
    if ":" in value:
        load_target(value, "task.options.environment")
    elif importlib.util.find_spec(value.replace("-", "_")) is None:
        raise ValueError(f"task.options.environment={value!r}: no installed module "
                         f"{value.replace('-', '_')!r} (install the environment, or name its "
                         "loader as path/to/env.py:load_environment).")


@attrs.frozen(kw_only=True)
class VerifiersTaskOptions:
    """`task.options` of `verifiers`."""

    environment: str = attrs.field(validator=_loadable)
    """An installed environment module (`vf.load_environment`), or `file.py:function`."""
    env_args: dict[str, Any] = attrs.field(factory=dict)
    """Keyword arguments of `load_environment`."""
    train_size: int = 0
    """Rows of the train split used (0: all)."""
    eval_size: int = 0
    """Rows of the eval split used (0: all)."""


class VerifiersTask(Task):
    """The rows of a verifiers environment's datasets; prompts as the environment made them."""

    name: ClassVar[str] = "verifiers"
    options_class: ClassVar[type] = VerifiersTaskOptions
    default_reward: ClassVar[str] = "exact_match"  # unused: the rubric scores episodes
    requires: ClassVar[tuple[str, ...]] = (MODULE,)
    extra: ClassVar[str] = EXTRA
    install_hint: ClassVar[str] = INSTALL_HINT

    def _env(self) -> Any:
        return load_vf_environment(self.options.environment, dict(self.options.env_args))

    def size(self, split: str) -> int:
        """The split's rows (at most `train_size` / `eval_size` when set)."""
        rows = len(_rows(self._env(), split))
        cap = self.options.train_size if split == "train" else self.options.eval_size
        return min(rows, cap) if cap else rows

    def example(self, split: str, index: int, seed: int) -> Example:
        """Row `index` of the split: its prompt, answer and where it came from."""
        if split not in ("train", "eval"):
            raise ValueError(f"task 'verifiers' has splits 'train' and 'eval', not {split!r}.")
        if not 0 <= index < self.size(split):
            raise IndexError(f"task 'verifiers' split {split!r} has {self.size(split)} rows; "
                             f"index {index} is out of range.")
        row = _rows(self._env(), split)[index]
        return Example(prompt=row["prompt"], answer=str(row.get("answer") or ""), index=index,
                       metadata={META_KEY: {"environment": self.options.environment,
                                            "env_args": dict(self.options.env_args),
                                            "split": split, "row": index}})

    def examples(self, split: str, seed: int) -> Iterator[Example]:
        """Yields every row of `split` in order."""
        for index in range(self.size(split)):
            yield self.example(split, index, seed)


class Scored(dict):
    """The rubric's weighted rewards by function (a dict: summed), with every raw score."""

    metrics: dict[str, float]


def run_episode(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> Scored:
    """Runs the example's row through its environment's `rollout` and `Rubric`.

    Args:
        base_url: The episode's endpoint URL.
        api_key: The endpoint's bearer token.
        model: The model name the endpoint serves.
        example: The example record (`verifiers` holds the environment and row).
    """
    from openai import AsyncOpenAI
    from verifiers.legacy.clients import OpenAIChatCompletionsClient

    spec = example.get(META_KEY)
    if not isinstance(spec, dict):
        raise ValueError("rollout.agent.environment: verifiers runs the rows of task.name: "
                         "verifiers; set task.name: verifiers with task.options.environment.")
    env = load_vf_environment(spec["environment"], spec["env_args"])
    row = dict(_rows(env, spec["split"])[spec["row"]])

    async def rollout() -> Any:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            return await env.run_rollout(row, OpenAIChatCompletionsClient(client), model, {})

    output = asyncio.run(rollout())
    if output.get("error"):
        raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
    metrics = {str(k): float(v) for k, v in (output.get("metrics") or {}).items()}
    weights = dict(zip(env.rubric._get_reward_func_names(), env.rubric._get_reward_weights()))
    scored = Scored({name: weights[name] * value for name, value in metrics.items()
                     if weights.get(name)})
    scored.metrics = metrics
    return scored


@attrs.frozen(kw_only=True)
class VerifiersOptions(AgentProgramOptions):
    """`rollout.agent.options` of `verifiers`: the policy endpoint's settings."""

    function: str = "peerflow.contrib.ecosystem.verifiers:run_episode"
    """The agent function: the environment's `rollout` and `Rubric` (leave it as it is)."""


class VerifiersEnvironment(AgentProgram):
    """A verifiers v0 rollout and rubric, as an agent program against the endpoint."""

    name: ClassVar[str] = "verifiers"
    options_class: ClassVar[type] = VerifiersOptions
    requires: ClassVar[tuple[str, ...]] = (MODULE, "fastapi", "uvicorn")
    extra: ClassVar[str] = EXTRA
    install_hint: ClassVar[str] = INSTALL_HINT

    def step(self, turn: Turn) -> StepResult:
        """The agent program's step; the rubric's raw scores join the last step's info."""
        result = super().step(turn)
        if result.done and self.outcome and self.outcome[0] == "done":
            metrics = getattr(self.outcome[1], "metrics", {})
            return attrs.evolve(result, info={**result.info, **{
                f"verifiers/{k}": v for k, v in metrics.items()}})
        return result
