"""The multi-turn rollout driver: episodes of an environment, token in and token out.

`AgentRollout` has the signature of `peerflow.rollout.generate.generate_batch`
(`engine, tokenizer, draws, sampling -> Batch`), so the sync `generate` node and the async
rollout loop run it unchanged when the config has a `rollout.agent` section. Per call:

1. every draw gets `sampling.n` environments (a GRPO group is `n` trajectories of one
   prompt); the first prompt is chat-templated once (with the environment's tool schemas);
   a group whose first prompts differ or overflow the model's context ends alone
   (`env_error`, `peerflow.agents.first_prompts`);
2. each turn, all open trajectories generate in **one** `engine.generate` call — the first
   turn samples `n` answers per prompt, later turns continue every trajectory's own token
   sequence with `n = 1`; the sampled tokens keep their log-probs and weight versions;
3. the environments of the trajectories step at once on threads
   (`rollout.agent.concurrency`), each under `step_timeout_s`; an error or time-out ends
   only its trajectory (`finish_reason` `env_error` / `env_timeout`, the text in
   `agent_error`);
4. observations are appended as tokens (`loss_mask` false, `rollout_logprobs` 0),
   rendered as chat-template continuations (`peerflow.agents.render`), never re-tokenising
   earlier turns;
5. between turns `between()` runs — in async mode the rollout loop applies newly pushed
   weights there, so a trajectory can span versions (`token_versions`; the sample's
   `weight_version` is its oldest token's).

Limits: `max_turns` (`finish_reason` `max_turns`), `max_total_tokens` after the prompt
(`max_tokens`), `max_turn_tokens` per turn (the turn is `truncated`, the episode goes on),
`max_observation_tokens` (the observation's end is dropped). An episode the environment
ends has `finish_reason` `stop`. An environment whose next input does not extend the
sequence returns `StepResult.restart`: that sample ends (`restart`) and the episode goes
on as a new sample of its group (`Trajectory.segment`), closed and rewarded once.
A failed sample keeps what ended it — its exception's type and traceback — for
`RUN_DIR/agent_errors.jsonl` (`peerflow.agents.failure_log`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from peerflow.agents.concurrent import Outcome, run_with_limits
from peerflow.agents.environment import Environment, StepResult, Turn
from peerflow.agents.first_prompts import (
    DIVERGED,
    TOO_LONG,
    divergence,
    first_prompt,
    model_context,
    past_context,
)
from peerflow.agents.metrics import FINISH_REASONS, record_episode_metrics  # noqa: F401 — re-exported
from peerflow.agents.packing import (  # noqa: F401 — re-exported
    AGENT_FAILURE,
    ENV_REWARD_COMPONENTS,
    SEGMENT_STRIDE,
    failure_of,
    pack_trajectories,
)
from peerflow.agents.render import TurnRenderer
from peerflow.agents.routes import add_observation_routes
from peerflow.agents.turns import Segments, sample_turns, swap_answers
from peerflow.algorithms.base import dataset_row
from peerflow.batch import LOSS_MASK, Batch  # noqa: F401 — LOSS_MASK re-exported
from peerflow.engines import RolloutEngine, SamplingParams
from peerflow.rollout.prompts import encode_prompt
from peerflow.rollout.sampler import Draw


@attrs.define(eq=False)
class Trajectory:
    """One episode in progress: the growing token sequence and what it has earned."""

    draw: Draw
    index: int
    """Which of the group's `n` trajectories."""
    env: Environment
    prompt: list[int]
    tokens: list[int] = attrs.field(factory=list)
    """Everything after the prompt: model turns and observations."""
    logprobs: list[float] = attrs.field(factory=list)
    mask: list[bool] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    token_rewards: list[float] = attrs.field(factory=list)
    """Each turn's `StepResult.reward` at that turn's last sampled token, else 0."""
    last_sampled: int = -1
    """Index (in `tokens`) of the last token the model sampled; -1 before any."""
    turns: int = 0
    info: dict[str, float] = attrs.field(factory=dict)
    """Sums of the numbers in the steps' `StepResult.info` (metrics `agent/<key>`)."""
    finish: str = ""
    """`finish_reason` once the episode is over, empty while it is open."""
    error: str = ""
    failure: dict[str, str] = attrs.field(factory=dict)
    """What ended it as `env_error`/`env_timeout`: `type` and `traceback` (`failure_of`)."""
    last_turn: Turn | None = None
    segment: int = 0
    """Which sample of its episode this is (> 0 after a `StepResult.restart`)."""
    routes: list[Any] = attrs.field(factory=list)
    """MoE engines: route rows per turn, or a count of -1 rows (`peerflow.agents.routes`)."""
    branches: list[Any] = attrs.field(factory=list)
    """The samples the last turn's other choices made (`peerflow.agents.turns`)."""

    def end(self, reason: str, error: str = "", failure: dict[str, str] | None = None) -> None:
        """Ends the episode (the first reason given wins); `failure`: `failure_of`'s."""
        if not self.finish:
            self.finish, self.error = reason, error
            if reason in ("env_error", "env_timeout"):
                self.failure = failure or failure_of(None, reason)

    def append(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
               sampled: bool) -> None:
        """Appends model tokens (`sampled`) or observation tokens to the sequence."""
        if sampled and len(ids):
            self.last_sampled = len(self.tokens) + len(ids) - 1
        self.tokens += [int(t) for t in ids]
        self.logprobs += [float(lp) for lp in logprobs]
        self.versions += [int(v) for v in versions]
        self.mask += [sampled] * len(ids)
        self.token_rewards += [0.0] * len(ids)

    def reward_turn(self, reward: float) -> None:
        """Puts a turn's reward on the last token the model sampled."""
        if reward and self.last_sampled >= 0:
            self.token_rewards[self.last_sampled] += float(reward)


@attrs.define(eq=False)
class AgentRollout:
    """Runs `rollout.agent` episodes; called like `generate_batch`."""

    env_cls: type[Environment]
    env_options: Any
    settings: Any
    """The run's `AgentConfig` (limits, time-outs, concurrency)."""
    rewards: tuple[Any, ...] = ()
    """The task's `environments` rewards its episodes score (`Environment.adopt_rewards`)."""

    @classmethod
    def from_config(cls, config: Any, pm: Any) -> AgentRollout | None:
        """Returns the driver of `config.rollout.agent`, or `None` without that section."""
        from peerflow.config import structure_options

        agent = config.rollout.agent
        if agent is None:
            return None
        env_cls = pm.get("environment", agent.environment)
        options = structure_options(env_cls.options_class, agent.options, "rollout.agent.options")
        rewards = ()
        if env_cls.scores_environment_rewards:
            from peerflow.rewards.setup import episode_rewards

            rewards = tuple(episode_rewards(config, pm))
        return cls(env_cls=env_cls, env_options=options, settings=agent, rewards=rewards)

    def __call__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        draws: Sequence[Draw],
        sampling: SamplingParams,
        *,
        between: Callable[[], None] = lambda: None,
        chunk_tokens: int = 0,
    ) -> Batch:
        """Runs one episode per draw and sample (`sampling.n` per draw).

        Args:
            engine: The rollout engine.
            tokenizer: The model's tokenizer (chat template, decoding).
            draws: Prompts drawn from the task.
            sampling: Sampling settings; `n` is the group size.
            between: Called between turns (async mode applies new weights there).
            chunk_tokens: With partial rollout, most tokens per generate call within a
                turn (weights may change between chunks); 0 generates each turn whole.

        Returns:
            A batch with the fields of `generate_batch` plus `loss_mask`,
            `token_versions`, `token_rewards` (each turn's reward on its last sampled
            token), `env_reward` (`final_reward()`, NaN for "let the task's reward score
            it"), `num_turns`, `agent_error` and `agent_info` (summed step infos).
        """
        if not draws:
            return Batch.empty()
        renderer = TurnRenderer(tokenizer)
        trajectories: list[Trajectory] = []
        segments = Segments()
        try:
            self._start(engine, tokenizer, draws, sampling, trajectories)
            for turn in range(self.settings.max_turns):
                active = [t for t in trajectories if not t.finish]
                if not active:
                    break
                if turn:
                    between()
                trajectories += sample_turns(engine, tokenizer, active, sampling, turn,
                                             self.settings, chunk_tokens, between, segments)
                trajectories += self._step([t for t in active if not t.finish], renderer, turn,
                                           segments)
            for t in trajectories:
                t.end("max_turns")
            return pack_trajectories(trajectories, *self._final_rewards(trajectories),
                                     sampling.n, engine.weight_version)
        finally:  # closes run like steps: at once, each under the time limit, errors dropped
            self._call_each(_episodes(trajectories), lambda t: t.env.close())

    def _start(self, engine: RolloutEngine, tokenizer: Any, draws: Sequence[Draw],
               sampling: SamplingParams, into: list[Trajectory]) -> None:
        """Creates `sampling.n` episodes per draw into `into`; makes their first prompts.

        Episodes go into `into` as they are made (so they are closed whatever happens);
        their first prompts are made at once, each under `step_timeout_s`.

        An episode whose first prompt fails (an agent program that raises, returns or
        waits past `wait_s` before its first call) ends alone (`env_error`/`env_timeout`,
        no tokens); so does every episode of a group whose first prompts differ or do not
        fit the model's context (`peerflow.agents.first_prompts`; the environments are
        told through `turn_failed`). An environment that cannot be constructed stops the
        batch.
        """
        for draw in draws:
            try:
                for k in range(sampling.n):
                    env = self.env_cls(draw.example, self.env_options)
                    into.append(Trajectory(draw=draw, index=k, env=env, prompt=[]))
                    env.prepare(sampling, engine.capabilities)
                    if self.rewards:
                        env.adopt_rewards(self.rewards)
            except Exception as exc:
                raise RuntimeError(
                    f"environment {self.env_cls.name!r} could not start an episode for "
                    f"{dataset_row(draw.example)} ({type(exc).__name__}: {exc}); its "
                    "__init__ must work for every example of the task.") from exc
        outcomes = self._call_each(into, lambda t: first_prompt(tokenizer, t.env))
        context = model_context(tokenizer)
        answer = min(self.settings.max_turn_tokens or sampling.max_tokens,
                     self.settings.max_total_tokens)
        left_out = []
        for draw in draws:
            group = [(t, o) for t, o in zip(into, outcomes) if t.draw is draw]
            prompts = [o.value for t, o in group if not self._failed(t, "initial prompt", o)]
            problem = divergence(prompts, self.env_cls.name, dataset_row(draw.example))
            kind = DIVERGED
            if prompts and not problem:
                problem, kind = past_context(len(prompts[0]), answer, context), TOO_LONG
            for t, _ in group:
                t.prompt = (list(prompts[0]) if prompts and not problem
                            else _stand_in(tokenizer, draw))
                if problem and not t.finish:  # the group is left out, the batch goes on
                    t.end("env_error", problem, failure_of(None, kind))
                    left_out.append(t)
        self._call_each(left_out, lambda t: t.env.turn_failed(t.error))

    def _step(self, trajectories: list[Trajectory], renderer: TurnRenderer,
              turn: int, segments: Segments) -> list[Trajectory]:
        """Steps the environments at once and appends their observations.

        Returns:
            The new samples episodes continue in (`StepResult.restart`).
        """
        restarted: list[Trajectory] = []
        outcomes = self._call_each(trajectories, lambda t: t.env.step(t.last_turn))
        for t, outcome in zip(trajectories, outcomes):
            if self._failed(t, "step", outcome):
                continue
            result: StepResult = outcome.value
            if not 0 <= result.choice <= len(t.branches):
                t.end("env_error", f"{self.env_cls.name}.step chose answer {result.choice} "
                      f"of a turn with {len(t.branches) + 1}")
                continue
            if result.choice:  # the episode went on with another of the turn's choices
                swap_answers(t, t.branches[result.choice - 1])
            t.reward_turn(result.reward)
            for key, value in result.info.items():
                if isinstance(value, int | float):
                    t.info[key] = t.info.get(key, 0.0) + float(value)
            if result.done:
                t.end("stop")
            elif turn + 1 >= self.settings.max_turns:
                t.end("max_turns")
            elif result.restart is not None:
                t.end("restart")
                segment = segments.next(t.env)
                restarted.append(Trajectory(draw=t.draw, index=t.index, env=t.env,
                                            prompt=[int(i) for i in result.restart],
                                            segment=segment, info={"segment": float(segment)}))
            else:
                self._observe(t, renderer, result)
        return restarted

    def _observe(self, t: Trajectory, renderer: TurnRenderer, result: StepResult) -> None:
        try:
            ids = renderer.observation(result, t.last_turn.token_ids if t.last_turn else ())
        except Exception as exc:  # noqa: BLE001 — a bad observation ends its trajectory
            t.end("env_error", f"observation of {self.env_cls.name} could not be "
                  f"rendered: {type(exc).__name__}: {exc}")
            return
        ids = ids[: self.settings.max_observation_tokens]
        if len(t.tokens) + len(ids) >= self.settings.max_total_tokens:
            t.end("max_tokens")
            return
        last = t.versions[-1] if t.versions else 0
        add_observation_routes(t, len(ids))
        t.append(ids, [0.0] * len(ids), [last] * len(ids), sampled=False)

    def _call_each(self, trajectories: list[Trajectory],
                   call: Callable[[Trajectory], Any]) -> list[Outcome]:
        """Calls `call(t)` for every trajectory at once, each under `step_timeout_s`."""
        return run_with_limits([lambda t=t: call(t) for t in trajectories],
                               timeout_s=self.settings.step_timeout_s,
                               concurrency=self.settings.concurrency)

    def _failed(self, t: Trajectory, what: str, outcome: Outcome) -> bool:
        """Marks `t` ended by an error or time-out of `what`; returns whether it failed."""
        if outcome.timed_out:
            t.finish, t.error = "env_timeout", (
                f"{self.env_cls.name}.{what} took longer than "
                f"rollout.agent.step_timeout_s={self.settings.step_timeout_s} s")
            t.failure = failure_of(None, "TimeoutError")
        elif outcome.error is not None:
            t.finish, t.error = "env_error", (
                f"{self.env_cls.name}.{what} raised {type(outcome.error).__name__}: "
                f"{outcome.error}")
            t.failure = failure_of(outcome.error)
        return not outcome.ok

    def _final_rewards(self, trajectories: list[Trajectory]
                       ) -> tuple[list[float], list[dict[str, float]]]:
        """Each episode's `final_reward()`, called once and shared by its samples.

        Returns:
            The outcome reward of each sample (NaN: let the task's rewards score it), and
            the named rewards it is the sum of (empty unless `final_reward` gave a dict).
        """
        episodes = _episodes(trajectories)
        by_env = {}
        for last, outcome in zip(episodes,
                                 self._call_each(episodes, lambda t: t.env.final_reward())):
            by_env[id(last.env)] = outcome
        rewards, named = [], []
        for t in trajectories:
            outcome = by_env[id(t.env)]
            value = None if self._failed(t, "final_reward", outcome) else outcome.value
            parts = {str(k): float(v) for k, v in value.items()} if isinstance(value,
                                                                                dict) else {}
            value = sum(parts.values()) if isinstance(value, dict) else value
            rewards.append(float("nan") if value is None else float(value))
            named.append(parts)
        return rewards, named


def _stand_in(tokenizer: Any, draw: Draw) -> list[int]:
    """The prompt of a group none of whose episodes started.

    The example's prompt as the task renders it; the samples carry no tokens and are left
    out as environment errors.
    """
    try:
        return encode_prompt(tokenizer, draw.example.prompt)
    except Exception:  # noqa: BLE001 — any prompt will do for a sample with no tokens
        return []


def _episodes(trajectories: list[Trajectory]) -> list[Trajectory]:
    """The last sample of each episode (one per environment)."""
    return list({id(t.env): t for t in trajectories}.values())
