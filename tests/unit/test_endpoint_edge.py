"""Attacks on the policy endpoint's edge, through the real endpoint and the one driver.

Each malformed call gets HTTP 400 in OpenAI's error shape naming the field (`param`), and
the run goes on: the same episode's next, valid call is answered and trained on. An
engine failure on one prompt fails only the episodes of that prompt (500 for their call).
Half-sent requests are dropped; the OpenEnv server a run starts refuses callers without
the run's bearer token.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from peerflow import SamplingParams
from peerflow.agents.endpoint.program import AgentProgram
from peerflow.agents.rollout import AgentRollout
from peerflow.algorithms.base import Example
from peerflow.config import AgentConfig
from peerflow.rollout.sampler import Draw
from tests.unit import agent_programs
from tests.unit.test_policy_endpoint import _options, chat_model, engine, tok  # noqa: F401

pytest.importorskip("openai")
CONTEXT = 2048  # the tiny chat model's positions
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def _vocab(tok) -> int:  # noqa: F811 — the fixture's tokenizer
    from transformers import AutoConfig

    return max(len(tok), AutoConfig.from_pretrained(tok.name_or_path).vocab_size)


def _attacks(vocab: int) -> list[tuple[str, dict, str]]:
    """(route, body, the field its 400 must name)."""
    nan = float("nan")
    long_ids = [5] * (CONTEXT + 10)
    return [
        ("generate", {"token_ids": [-1]}, "token_ids.0"),
        ("generate", {"token_ids": [3, vocab]}, "token_ids.1"),
        ("generate", {"token_ids": long_ids}, "token_ids"),
        ("generate", {"token_ids": "abc"}, "token_ids"),
        ("generate", {"token_ids": [3], "sampling_params": {"seed": 10**30}},
         "sampling_params.seed"),
        ("completion", {"prompt": [-5]}, "prompt.0"),
        ("completion", {"prompt": [vocab + 7]}, "prompt.0"),
        ("completion", {"prompt": "word " * (CONTEXT + 10)}, "prompt"),
        ("chat", {**CHAT, "messages": [{"role": "user", "content": "word " * (CONTEXT + 10)}]},
         "messages"),
        ("chat", {**CHAT, "messages": "hi"}, "messages"),
        ("chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("chat", {**CHAT, "seed": 10**30}, "seed"),
        ("chat", {**CHAT, "seed": -1}, "seed"),
        ("chat", {**CHAT, "seed": 1.5}, "seed"),
        ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("chat", {**CHAT, "max_tokens": -3}, "max_tokens"),
        ("chat", {**CHAT, "max_tokens": 10**30}, "max_tokens"),
        ("chat", {**CHAT, "max_completion_tokens": CONTEXT + 1}, "max_completion_tokens"),
        ("chat", {**CHAT, "n": 0}, "n"),
        ("chat", {**CHAT, "n": 3000}, "n"),
        ("chat", {**CHAT, "n": "three"}, "n"),
        ("chat", {**CHAT, "temperature": -1}, "temperature"),
        ("chat", {**CHAT, "temperature": nan}, "temperature"),
        ("chat", {**CHAT, "top_p": 0}, "top_p"),
        ("chat", {**CHAT, "top_p": 1.5}, "top_p"),
        ("chat", {**CHAT, "top_p": nan}, "top_p"),
        ("chat", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids.0"),
        ("chat", {**CHAT, "stop_token_ids": [vocab]}, "stop_token_ids.0"),
        ("chat", {**CHAT, "stop": 5}, "stop"),
        ("chat", {**CHAT, "stop": [""]}, "stop.0"),  # engines raise on it: the turn failed
        ("chat", {**CHAT, "stop": ""}, "stop"),
        ("chat", {**CHAT, "stop": ["x" * 100_000]}, "stop.0"),
        ("chat", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
         "messages.0.content"),
        ("completion", {"prompt": "a \udfff b"}, "prompt"),
        ("chat", {**CHAT, "session_id": {"a": 1}}, "session_id"),
        ("chat", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]},
         "messages.0.tool_calls.0.id"),
    ]


def _run(engine, function: str, n: int = 2, **options):  # noqa: F811
    agent_programs.RECORDS.clear()
    draws = [Draw(position=i, example=Example(prompt=p, index=i))
             for i, p in enumerate(["1+2=", "ab"])]
    driver = AgentRollout(env_cls=AgentProgram,
                          env_options=_options(function, wait_s=60, **options),
                          settings=AgentConfig(environment="agent-program", max_turns=1,
                                               max_total_tokens=400))
    return driver(engine, engine.tokenizer, draws,
                  SamplingParams(n=n, temperature=1.0, max_tokens=4, seed=3))


def test_each_malformed_call_gets_400_naming_its_field_and_the_run_goes_on(engine, tok):  # noqa: F811
    attacks = _attacks(_vocab(tok))
    agent_programs.ATTACKS[:] = [(route, body) for route, body, _ in attacks]
    batch = _run(engine, "hostile_agent")
    assert batch["finish_reason"] == ["stop"] * 4  # every episode went on to its good call
    assert len(agent_programs.RECORDS) == 4
    for answers in agent_programs.RECORDS:
        *refused, good = answers
        for (route, body, param), answer in zip(attacks, refused):
            error = answer["body"]["error"]
            assert (answer["status"], error["type"], error["param"]) == (
                400, "invalid_request_error", param), (route, body if len(str(body)) < 200
                                                       else param, answer)
            assert error["message"]
        assert good["status"] == 200 and good["body"]["choices"][0]["message"]["role"] == (
            "assistant")


def test_n_is_capped_by_the_setting(engine):  # noqa: F811
    agent_programs.ATTACKS[:] = [("chat", {**CHAT, "n": 3})]
    _run(engine, "hostile_agent", max_n=2)
    for answers in agent_programs.RECORDS:
        error = answers[0]["body"]["error"]
        assert answers[0]["status"] == 400 and error["param"] == "n"
        assert "rollout.agent.options.max_n=2" in error["message"]
    agent_programs.ATTACKS[:] = [("chat", {**CHAT, "n": 2})]  # at the run's n: allowed
    _run(engine, "hostile_agent")
    assert all(a[0]["status"] == 200 and len(a[0]["body"]["choices"]) == 2
               for a in agent_programs.RECORDS)


class _FailsOn:
    """The real engine, made to raise on prompts that hold `marker` (a fault injector)."""

    def __init__(self, engine, marker: list[int]) -> None:  # noqa: F811
        self.engine, self.marker, self.calls = engine, marker, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, sampling):
        self.calls += 1
        for r in requests:
            ids = list(r.prompt_ids)
            if any(ids[i:i + len(self.marker)] == self.marker for i in range(len(ids))):
                raise RuntimeError("injected engine failure")
        return self.engine.generate(requests, sampling)


def test_an_engine_failure_fails_only_its_episodes(engine, tok):  # noqa: F811
    marker = tok("ab", add_special_tokens=False)["input_ids"]
    faulty = _FailsOn(engine, marker)
    batch = _run(faulty, "engine_failure_agent")
    reasons = batch["finish_reason"]
    assert sorted(reasons) == ["env_error"] * 2 + ["stop"] * 2
    failed = [e for e, r in zip(batch["agent_error"], reasons) if r == "env_error"]
    assert all("injected engine failure" in e for e in failed)
    statuses = sorted((r[0]["prompt"], r[0]["status"]) for r in agent_programs.RECORDS)
    assert statuses == [("1+2=", 200), ("1+2=", 200), ("ab", 500), ("ab", 500)]


def test_every_request_failing_is_the_engines_fault_and_stops_the_batch(engine, tok):  # noqa: F811
    faulty = _FailsOn(engine, [])  # the empty marker is in every prompt
    with pytest.raises(RuntimeError, match="injected engine failure"):
        _run(faulty, "engine_failure_agent")


def _endpoint(**limits):
    from peerflow.agents.endpoint.server import PolicyEndpoint
    from peerflow.agents.endpoint.serving import ServeLimits

    endpoint = PolicyEndpoint(host="127.0.0.1", port=0, token="edge-token",
                              limits=ServeLimits(**limits))
    endpoint.start()
    return endpoint


def _read_all(sock) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed)."""
    chunks = []
    try:
        for chunk in iter(lambda: sock.recv(4096), b""):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_the_endpoint_a_run_builds_has_every_connection_limit():
    from peerflow.agents.endpoint.server import endpoint_for
    from peerflow.agents.endpoint.serving import DeadlineH11Protocol

    config = endpoint_for("127.0.0.1", 0, "edge-token", "policy")._server.config
    assert issubclass(config.http, DeadlineH11Protocol) and config.http.read_timeout_s == 10
    assert (config.limit_concurrency, config.timeout_keep_alive,
            config.h11_max_incomplete_event_size) == (4096, 5, 64 * 1024)


def test_a_half_sent_request_is_dropped():
    endpoint = _endpoint(read_timeout_s=1.0)
    for half in (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le",  # headers
                 b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"  # the body
                 b"Authorization: Bearer edge-token\r\nContent-Length: 100\r\n\r\n{"):
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
            sock.sendall(half)
            _read_all(sock)  # returns once the server closes the connection
        assert 0.9 < time.monotonic() - start < 5
    ok = httpx.get(f"http://127.0.0.1:{endpoint.port}/v1/models",
                   headers={"Authorization": "Bearer edge-token"})
    assert ok.status_code == 200  # the server goes on serving
    endpoint.stop()


def test_oversized_headers_and_bodies_are_refused():
    endpoint = _endpoint(max_body_bytes=1000)
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000)
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400") or answer == b""  # refused, or reset
    assert time.monotonic() - start < 5
    auth = {"Authorization": "Bearer edge-token"}
    url = f"http://127.0.0.1:{endpoint.port}/episodes/e/v1/completions"
    big = httpx.post(url, json={"prompt": "x" * 2000}, headers=auth)
    assert big.status_code == 413
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    wrong = httpx.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer é".encode()})
    assert wrong.status_code == 401  # a non-ASCII header is just a wrong token
    endpoint.stop()


def test_a_pipelined_request_trickled_byte_by_byte_is_dropped():
    endpoint = _endpoint(read_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer edge-token"
                     b"\r\n\r\nPOST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: "
                     b"Bearer edge-token\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)  # the first answer is sent; the second request waits for its body
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < 8 and not closed:
            try:
                sock.sendall(b" ")  # a byte every 0.2 s: the keep-alive timer never fires
            except OSError:
                closed = True
            time.sleep(0.2)
        assert closed and time.monotonic() - start < 4
    endpoint.stop()


def test_json_nested_past_the_recursion_limit_is_400():
    endpoint = _endpoint()
    url = f"http://127.0.0.1:{endpoint.port}/episodes/e/v1/completions"
    deep = httpx.post(url, content=b"[" * 5000, headers={"Authorization": "Bearer edge-token"})
    assert deep.status_code == 400 and "not JSON" in deep.json()["error"]["message"]
    endpoint.stop()


@pytest.mark.parametrize("stop", ["x" * 100, ["ab", "\n"], ["y"] * 64, "z" * 1024])
def test_valid_stop_strings_are_accepted(stop):
    """One stop string longer than 64 characters was refused as "more than 64 items"."""
    from peerflow.agents.endpoint.protocol import ChatRequest

    body = ChatRequest.model_validate({**CHAT, "stop": stop})
    assert body.stop == stop

