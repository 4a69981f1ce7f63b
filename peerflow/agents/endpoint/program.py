"""Agent programs: a user function runs each episode with an OpenAI client.

PeerFlow trains on the calls it made.

`rollout.agent.environment: agent-program` with `options.function: agent.py:run_episode`.
Per trajectory, the function runs on its own thread as

    run_episode(base_url=..., api_key=..., model=..., example={prompt, answer, ...})

and talks to the policy endpoint (`peerflow.agents.endpoint.server`) under the episode's
`base_url`. It returns the episode's reward (a float; a dict of named rewards, summed,
each a reward component; or `None` to let the task's reward score the trajectory's text).

This is an `Environment` of the one agent driver (`peerflow.agents.rollout`), turned
inside out: a call's prompt is the driver's next input, and what the driver samples for it
is the call's answer.

* The first call is the first prompt (`initial_prompt_ids`): its token ids, exactly as the
  endpoint rendered them. The `n` episodes of a group must start with the same call.
* `step(turn)` answers the pending call with the turn the driver sampled (the engine's own
  token ids, log-probs and text), then waits for the program's next move: another call
  continues the trajectory when its prompt extends the one before exactly — the new chat
  messages rendered as a continuation (`TurnRenderer`, never re-rendering earlier turns),
  or the new tokens of a completion or generate call — and those tokens are the
  observation (appended exactly, masked out of the loss); the program returning ends the
  episode. With `n > 1` the call extends one of the choices (`StepResult.choice`); the
  others are samples of their own (`branch`). A call's sampling settings are checked when
  it is taken (`sampling.refusal`: 400 and wait for the next) and passed to the driver
  (`turn_settings`); so is its rendered prompt's length against the model's context.
* A call whose prompt does not extend the trajectory (the program rewrote an earlier turn,
  or dropped history) ends that sample (`finish_reason` `restart`, `prefix_breaks` in its
  `agent_info`) and starts a new sample of the episode from the call's whole prompt
  (`StepResult.restart`; its `agent_info` has `segment`); both get the episode's reward.
* Every call is validated when it arrives (`protocol`, against `limits`): a malformed one
  is answered 400 naming the field and never reaches the driver. The program starts in
  `initial_prompt_ids`, once those limits are known. A call the engine fails on is
  answered 500 (`turn_failed`); its episode ends, the others go on.
* A trajectory a `rollout.agent` limit ends (max_turns, max_total_tokens) has its pending
  call answered 503; the program's reward then still counts, or `cut_reward` when the
  program raised on that answer.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from concurrent.futures import Future
from typing import Any, ClassVar

from peerflow.agents.endpoint.limits import RequestLimits, model_limits
from peerflow.agents.endpoint.options import AgentProgramOptions
from peerflow.agents.endpoint.protocol import (
    Call,
    Reply,
    chat_response,
    completion_response,
    error_body,
    generate_response,
    normal_message,
)
from peerflow.agents.environment import Environment, StepResult, Turn, TurnSettings
from peerflow.algorithms.base import Example


class AgentProgram(Environment):
    """One episode of a user's OpenAI-client agent function, recorded token-exactly."""

    name: ClassVar[str] = "agent-program"
    options_class: ClassVar[type] = AgentProgramOptions
    requires: ClassVar[tuple[str, ...]] = ("fastapi", "uvicorn")
    extra: ClassVar[str] = "endpoint"

    def __init__(self, example: Example, options: AgentProgramOptions) -> None:
        super().__init__(example, options)
        from peerflow.agents.endpoint.server import endpoint_for
        from peerflow.agents.endpoint.serving import run_token
        from peerflow.rewards.loading import load_function, parse_target

        token = os.environ[options.token_env] if options.token_env else run_token()
        self.endpoint = endpoint_for(options.host, options.port, token, options.model_name)
        self.id = uuid.uuid4().hex
        self.inbox: queue.Queue[tuple[str, Any, Future | None]] = queue.Queue()
        self.pending: tuple[Call, Future] | None = None
        self.sequence: list[int] = []
        """The trajectory's tokens so far: first prompt, turns and observations."""
        self.histories: list[list[dict[str, Any]]] = []
        """After a chat answer: the history each of its choices would make."""
        self.run_sampling: Any = None
        self.capabilities: Any = None
        self.tools: tuple[dict[str, Any], ...] = ()
        self.tokenizer: Any = None
        self.limits: RequestLimits | None = None
        """What this episode's calls are validated against (set before the program runs)."""
        self.outcome: tuple[str, Any] | None = None
        self.cut = ""
        self.endpoint.add(self.id, self)
        fn = load_function(parse_target(options.function), "rollout.agent.options.function")
        self.thread = threading.Thread(target=self._run, args=(fn, token), daemon=True,
                                       name=f"agent-{self.id[:8]}")

    def _run(self, fn: Any, token: str) -> None:
        from peerflow.rewards.scoring import example_record

        try:
            value = fn(base_url=self.endpoint.base_url(self.id), api_key=token,
                       model=self.options.model_name, example=example_record(self.example))
        except BaseException as exc:  # noqa: BLE001 — reported by the driver's thread
            self.inbox.put(("error", exc, None))
        else:
            self.inbox.put(("done", value, None))

    def submit(self, call: Call) -> Future:
        """Queues a call from the endpoint; the future gets `(status, body)`."""
        future: Future = Future()
        if self.cut:
            future.set_result(self._refusal())
        else:
            self.inbox.put(("call", call, future))
        return future

    def _refusal(self) -> tuple[int, dict[str, Any]]:
        if self.cut not in ("", "limit"):  # the driver ended it for a reason of its own
            return 503, error_body(f"the episode's trajectory has ended: {self.cut}; return "
                                   "from the episode (the run goes on).")
        return 503, error_body("the episode's trajectory has ended (a rollout.agent limit: "
                               "max_turns or max_total_tokens); return from the episode.")

    def _next(self) -> tuple[str, Any, Future | None]:
        try:
            return self.inbox.get(timeout=self.options.wait_s)
        except queue.Empty:
            error = TimeoutError(f"the agent program made no call and did not return within "
                                 f"rollout.agent.options.wait_s={self.options.wait_s} s")
            self.outcome = self.outcome or ("error", error)  # final_reward waits no more
            raise error from None

    def _next_move(self) -> tuple[str, Any, Future | None]:
        """The program's next call this run can honour (others are answered 400), or end."""
        from peerflow.agents.endpoint.sampling import refusal

        while True:
            kind, value, future = self._next()
            problem = None if kind != "call" or self.run_sampling is None else refusal(
                value.sampling, self.run_sampling, self.capabilities)
            if problem is None:
                return kind, value, future
            future.set_result((400, error_body(str(problem), param=problem.param)))

    def prepare(self, sampling: Any, capabilities: Any) -> None:
        """Keeps the run's sampling settings and the engine's capabilities.

        Every call's own settings are checked against them when the driver takes the
        call (`peerflow.agents.endpoint.sampling.refusal`).
        """
        self.run_sampling, self.capabilities = sampling, capabilities

    def turn_settings(self) -> TurnSettings:
        """The pending call's `n`, `max_tokens`, `stop` and `seed`, for the driver."""
        if self.pending is None:
            return TurnSettings()
        return self.pending[0].sampling.turn_settings()

    def initial_prompt_ids(self, tokenizer: Any) -> list[int]:
        """Starts the program; its first call's prompt token ids start the trajectory.

        The program starts here, once the limits its calls are validated against are
        known (the model's, from `tokenizer`; the run's, from `prepare`).
        """
        self.tokenizer = tokenizer
        self.limits = model_limits(tokenizer, self.run_sampling, self.options.max_n)
        self.thread.start()
        while True:
            kind, value, future = self._next_move()
            if kind != "call":
                self.outcome = (kind, value)
                raise RuntimeError("the agent program ended before calling the model: "
                                   f"{value!r}" if kind == "done" else
                                   f"the agent program raised {type(value).__name__}: {value}")
            ids = self._fitting(value, future, self._rendered)
            if ids is not None:
                break
        self.sequence, self.pending, self.tools = list(ids), (value, future), value.tools
        self.histories = []
        return list(ids)

    def initial_prompt(self) -> str:
        """Unused: the first prompt comes from the program's first call."""
        return ""

    def step(self, turn: Turn) -> StepResult:
        """Answers the pending call with `turn` and its other choices; returns the next move.

        The next move names the choice the program went on with (`StepResult.choice`).
        """
        assert self.pending is not None, "step without a pending call"
        call, future = self.pending
        self.pending = None
        choices = [turn, *turn.alternatives]
        replies = [Reply(prompt_ids=tuple(self.sequence), token_ids=c.token_ids,
                         logprobs=c.logprobs, text=self._text(call, c),
                         finish_reason="length" if c.truncated else "stop") for c in choices]
        future.set_result((200, self._respond(call, replies, turn.index)))
        while True:
            kind, value, next_future = self._next_move()
            if kind == "error":
                self.outcome = (kind, value)
                raise RuntimeError(f"the agent program raised {type(value).__name__}: {value}")
            if kind == "done":
                self.outcome = (kind, value)
                return StepResult(done=True)
            assert next_future is not None
            found = self._fitting(value, next_future, lambda c: self._extended(c, choices))
            if found is not None:
                break
        choice, ids = found
        self.pending = (value, next_future)
        if choice is None:  # a new sample of this episode starts from the call's prompt
            self.sequence = list(ids)
            self.tools = value.tools
            return StepResult(restart=ids, info={"prefix_breaks": 1})
        self.sequence += list(choices[choice].token_ids) + ids
        return StepResult(observation=ids, choice=choice)

    def _text(self, call: Call, turn: Turn) -> str:
        if call.skip_special_tokens:
            return turn.text
        return self.tokenizer.decode(list(turn.token_ids), skip_special_tokens=False)

    def _fitting(self, call: Call, future: Future, prompt_of: Any) -> Any:
        """What `prompt_of(call)` found, or `None` when the prompt is past the context.

        `prompt_of` returns what it found and the length of the call's whole prompt; a
        prompt the model's context cannot answer is answered 400 naming its field, and the
        episode waits for the program's next call.

        Raises:
            Exception: Whatever else `prompt_of` raised (answered 400 first): the episode
                ends as `env_error`.
        """
        try:
            found, whole = prompt_of(call)
        except Exception as exc:
            future.set_result((400, error_body(f"{type(exc).__name__}: {exc}")))
            raise
        why = (self.limits or RequestLimits()).room(whole, call.sampling.max_tokens)
        if not why:
            return found
        param = {"chat": "messages", "completion": "prompt"}.get(call.kind, "token_ids")
        future.set_result((400, error_body(f"{param}: {why}", param=param)))
        return None

    def _rendered(self, call: Call) -> tuple[list[int], int]:
        ids = self._render(call)
        return ids, len(ids)

    def _extended(self, call: Call, choices: list[Turn]) -> tuple[Any, int]:
        choice, ids = self._extension(call, choices)
        if choice is None:
            return (choice, ids), len(ids)
        return (choice, ids), len(self.sequence) + len(choices[choice].token_ids) + len(ids)

    def _render(self, call: Call) -> list[int]:
        """A call's whole prompt as token ids (chat templated, text tokenised, ids as given)."""
        if call.ids is not None:
            return [int(i) for i in call.ids]
        if call.text is not None:
            return [int(i) for i in self.tokenizer(call.text, add_special_tokens=True)
                    ["input_ids"]]
        messages = [dict(m) for m in call.messages]
        if call.tools:
            from peerflow.agents.tools import render_prompt

            return render_prompt(self.tokenizer, messages, list(call.tools))
        from peerflow.rollout.prompts import encode_prompt

        return encode_prompt(self.tokenizer, messages)

    def _extension(self, call: Call, choices: list[Turn]) -> tuple[int | None, list[int]]:
        """Which choice `call` extends, with the tokens it adds; else `None` and its prompt.

        A chat call extends choice k when its messages start with the history that choice
        made (only the new messages are rendered, as a continuation); any call extends it
        when its whole prompt's tokens start with the trajectory's tokens and that answer.
        """
        for k, history in enumerate(self.histories):
            if (call.kind == "chat" and call.tools == self.tools
                    and len(call.messages) > len(history)
                    and list(call.messages[:len(history)]) == history):
                from peerflow.agents.render import TurnRenderer

                new = [dict(m) for m in call.messages[len(history):]]
                return k, TurnRenderer(self.tokenizer).observation(
                    StepResult(observation=new), choices[k].token_ids)
        ids = self._render(call)
        for k, turn in enumerate(choices):
            done = self.sequence + list(turn.token_ids)
            if len(ids) > len(done) and ids[:len(done)] == done:
                return k, ids[len(done):]
        return None, ids

    def _respond(self, call: Call, replies: list[Reply], index: int) -> Any:
        """The answer's body: a dict, or the list of chunks of a streamed one."""
        from peerflow.agents.endpoint import stream

        self.histories = []
        if call.kind == "completion":
            if call.stream:
                return stream.completion_chunks(call, replies, self.tokenizer)
            return completion_response(call, replies, self.tokenizer)
        if call.kind == "generate":
            return generate_response(call, replies)
        messages = [_assistant_message(r, bool(call.tools), index) for r in replies]
        self.histories = [list(call.messages) + [normal_message(m)] for m, _ in messages]
        if call.stream:
            return stream.chat_chunks(call, replies, messages, self.tokenizer)
        return chat_response(call, replies, messages, self.tokenizer)

    def turn_failed(self, error: str) -> None:
        """The driver ended the episode: the pending call is answered 500, later ones 503.

        Both carry `error` (the engine failed on the pending call's prompt, or the group
        cannot start: `peerflow.agents.first_prompts`).
        """
        self.cut = self.cut or error
        if self.pending is not None:
            self.pending[1].set_result((500, error_body(
                f"{error}; this episode has ended (the run goes on).", "server_error")))
            self.pending = None

    def final_reward(self) -> float | dict[str, float] | None:
        """The program's reward, once it returns.

        A cut episode's pending call is answered 503 first, so the program can return.
        """
        if self.pending is not None:
            self.cut = self.cut or "limit"
            self.pending[1].set_result(self._refusal())
            self.pending = None
        while self.outcome is None:
            kind, value, future = self._next()
            if kind == "call":
                self.cut = self.cut or "limit"
                future.set_result(self._refusal())
            else:
                self.outcome = (kind, value)
        kind, value = self.outcome
        if kind == "error":
            if self.cut:
                return float(self.options.cut_reward)
            raise RuntimeError(f"the agent program raised {type(value).__name__}: {value}")
        if value is None or isinstance(value, dict):
            return value  # named rewards: the driver sums them and keeps each as a component
        return float(value)

    def close(self) -> None:
        """Stops routing calls to the episode; a call still waiting is answered 503."""
        self.endpoint.remove(self.id)
        self.cut = self.cut or "limit"
        if self.pending is not None:
            self.pending[1].set_result(self._refusal())
            self.pending = None
        while True:  # calls that arrived after the last step: answered, never left waiting
            try:
                kind, _, future = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call" and future is not None and not future.done():
                future.set_result(self._refusal())


def _assistant_message(reply: Reply, tools: bool, index: int) -> tuple[dict[str, Any], str]:
    """The chat message of a reply: its text, and its tool calls when tools were offered."""
    if not tools:
        return {"role": "assistant", "content": reply.text}, reply.finish_reason
    import json

    from peerflow.agents.tool_calls import parse_tool_calls, text_before_calls

    calls = [c for c in parse_tool_calls(reply.text) if not c.error]
    if not calls:
        return {"role": "assistant", "content": reply.text}, reply.finish_reason
    tool_calls = [{"id": f"call_{index}_{k}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                  for k, c in enumerate(calls)]
    return ({"role": "assistant", "content": text_before_calls(reply.text),
             "tool_calls": tool_calls}, "tool_calls")
