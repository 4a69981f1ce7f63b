"""Chat-template continuations: observations never re-tokenise earlier turns.

The tokenizer carries a real HF chat template (ChatML turns, as Qwen2.5's, with
`content | trim` as Llama 3's templates do) run by `apply_chat_template`.
"""

from __future__ import annotations

import pytest
import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents import StepResult, Turn
from peerflow.agents.render import TurnRenderer
from peerflow.agents.rollout import LOSS_MASK, AgentRollout
from peerflow.algorithms.base import Example
from peerflow.config import AgentConfig
from peerflow.engines import EngineContext
from peerflow.rollout.prompts import encode_prompt
from peerflow.rollout.sampler import Draw
from tests.unit.test_agents_rollout import Echo

CHATML = (
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] | trim) + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """The tiny Llama with `<|im_start|>`/`<|im_end|>` tokens and a ChatML template."""
    from tests.helpers.chat_model import build_chatml_llama

    return build_chatml_llama(tmp_path_factory.mktemp("tiny-chat"), CHATML)


@pytest.fixture(scope="module")
def tok(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _rerendered(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_continuation_equals_rerendering_when_turn_text_round_trips(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = TurnRenderer(tok)
    prompt = encode_prompt(tok, "12+3=")
    turn1 = _ids(tok, "15") + [end]
    obs1 = renderer.observation(StepResult(observation="no, again"), turn1)
    turn2 = _ids(tok, "16") + [end]
    tool_and_user = [{"role": "tool", "content": "3"}, {"role": "user", "content": "and?"}]
    obs2 = renderer.observation(StepResult(observation=tool_and_user), turn2)
    ours = prompt + turn1 + obs1 + turn2 + obs2
    messages = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": "15"},
                {"role": "user", "content": "no, again"},
                {"role": "assistant", "content": "16"}, *tool_and_user]
    assert ours == _rerendered(tok, messages)
    assert tok.decode(obs1) == "\n<|im_start|>user\nno, again<|im_end|>\n<|im_start|>assistant\n"


def test_rerendering_would_change_sampled_tokens_the_continuation_keeps(tok):
    """Where re-rendering differs: the template trims the content the model sampled, and
    decoding drops a special token sampled inside a turn; a turn cut at its length limit
    (no `<|im_end|>` sampled) is closed by the continuation."""
    end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    renderer = TurnRenderer(tok)
    prompt = encode_prompt(tok, "12+3=")
    turn1 = _ids(tok, " 15 ") + [end]  # sampled spaces around the answer
    obs1 = renderer.observation(StepResult(observation="no"), turn1)
    turn2 = _ids(tok, "1") + [pad] + _ids(tok, "6")  # a special token mid-turn, then cut
    obs2 = renderer.observation(StepResult(observation="ok"), turn2)
    ours = prompt + turn1 + obs1 + turn2 + obs2
    texts = [tok.decode(t, skip_special_tokens=True) for t in (turn1, turn2)]
    rerendered = _rerendered(tok, [
        {"role": "user", "content": "12+3="}, {"role": "assistant", "content": texts[0]},
        {"role": "user", "content": "no"}, {"role": "assistant", "content": texts[1]},
        {"role": "user", "content": "ok"}])
    # ours holds every sampled token at its place
    assert ours[len(prompt):len(prompt) + len(turn1)] == turn1
    start2 = len(prompt) + len(turn1) + len(obs1)
    assert ours[start2:start2 + len(turn2)] == turn2
    # re-rendering differs right at the first sampled token (the trimmed space) …
    first_diff = next(i for i, (a, b) in enumerate(zip(ours, rerendered)) if a != b)
    assert first_diff == len(prompt)
    assert tok.decode(rerendered).count("<pad>") == 0 and pad in ours
    assert len(rerendered) == len(ours) - 3  # two spaces and the pad token are gone
    # … and the cut turn is closed by the template's end-of-turn, not left open
    assert obs2[0] == end and obs1[0] != end


def test_tokenizer_without_template_and_token_observations(tiny_model):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tiny_model)
    renderer = TurnRenderer(plain)
    assert renderer.observation(StepResult(observation="no, 42"), [5]) == _ids(plain, "no, 42")
    messages = [{"role": "tool", "content": "7"}, {"role": "user", "content": "go"}]
    assert renderer.observation(StepResult(observation=messages), [5]) == _ids(plain, "7\ngo")
    assert renderer.observation(StepResult(observation=[3, 4, 0]), [5]) == [3, 4, 0]


def test_driver_with_a_chat_template_is_token_exact(chat_model, tok):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.engines import OptimSettings

    engine = HFRolloutEngine(EngineContext(model_path=chat_model, layout=ParallelLayout()))
    draws = [Draw(position=i, example=Example(prompt=p)) for i, p in enumerate(["1+2=", "ab"])]
    driver = AgentRollout(env_cls=Echo, env_options=None,
                          settings=AgentConfig(environment="echo-test", max_turns=3))
    batch = driver(engine, tok, draws, SamplingParams(n=2, temperature=0.8, max_tokens=5,
                                                       seed=4))
    renderer = TurnRenderer(tok)
    for prompt, ids, mask in zip(batch.ragged("prompt_ids").rows(),
                                 batch.ragged("response_ids").rows(),
                                 batch.ragged(LOSS_MASK).rows(), strict=True):
        assert prompt.tolist() == encode_prompt(tok, "1+2=") or \
            prompt.tolist() == encode_prompt(tok, "ab")
        ids, mask = ids.tolist(), mask.tolist()
        # every observation is the continuation rendered after the turn before it
        i = 0
        while i < len(ids):
            j = i
            while j < len(ids) and mask[j] == mask[i]:
                j += 1
            if not mask[i]:
                turn_start = max(k for k in range(i) if k == 0 or not mask[k - 1])
                want = renderer.observation(StepResult(observation=Echo.observation),
                                            ids[turn_start:i])
                assert ids[i:j] == want
                assert tok.decode(want).endswith("<|im_start|>assistant\n")
            i = j
    trainer = FSDPTrainEngine(
        EngineContext(model_path=chat_model, layout=ParallelLayout(), temperature=0.8),
        FSDPTrainOptions(), OptimSettings())
    trained = trainer.forward_logprobs(batch)
    for got, want, keep in zip(trained.rows(), batch.ragged("rollout_logprobs").rows(),
                               batch.ragged(LOSS_MASK).rows(), strict=True):
        assert torch.allclose(got[keep], want[keep], atol=1e-4)


def test_tool_results_continue_the_conversation_as_the_qwen_template_renders_them(
        plugin_manager):
    """A real tool call: ToolEnvironment runs it sandboxed; its `tool` messages (grouped in
    one user turn by the Qwen2.5-style template) continue the token sequence exactly as
    re-rendering the whole conversation would (its text round-trips)."""
    from peerflow.agents.tool_env import ToolEnvironment, ToolOptions
    from peerflow.agents.tools import render_prompt
    from tests.helpers.chat_model import build_chat_tokenizer

    tok = build_chat_tokenizer()
    env = ToolEnvironment(Example(prompt="What is 6 * 7?", answer="42"),
                          ToolOptions(tools=("calculator",)))
    schemas = env.tool_schemas()
    first = env.initial_prompt()
    first = [{"role": "user", "content": first}] if isinstance(first, str) else first
    prompt = render_prompt(tok, first, schemas)
    call = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "6 + 7"}}\n</tool_call>')
    turn_ids = _ids(tok, call) + [tok.eos_token_id]
    result = env.step(Turn(token_ids=turn_ids, text=call, index=0))
    env.close()
    assert [m["role"] for m in result.observation] == ["tool", "tool"]
    obs = TurnRenderer(tok).observation(result, turn_ids)
    rerendered = tok.apply_chat_template(
        [*first, {"role": "assistant", "content": call}, *result.observation],
        tools=schemas, add_generation_prompt=True, tokenize=True)
    rerendered = list(rerendered["input_ids"] if hasattr(rerendered, "keys") else rerendered)
    assert prompt + turn_ids + obs == rerendered
    assert tok.decode(obs).count("<|im_start|>user") == 1  # both results in one user turn
    assert "42" in tok.decode(obs) and "13" in tok.decode(obs)


def test_driver_renders_the_first_prompt_with_the_tool_schemas(plugin_manager, tmp_path):
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.agents.tool_env import ToolEnvironment, ToolOptions
    from peerflow.agents.tools import render_prompt
    from tests.helpers.chat_model import build_chat_model

    path = build_chat_model(tmp_path)
    engine = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    options = ToolOptions(tools=("calculator",))
    driver = AgentRollout(env_cls=ToolEnvironment, env_options=options,
                          settings=AgentConfig(environment="tools", max_turns=2))
    example = Example(prompt="What is 6 * 7?", answer="42")
    batch = driver(engine, engine.tokenizer, [Draw(position=0, example=example)],
                   SamplingParams(n=2, temperature=0.9, max_tokens=8, seed=1))
    env = ToolEnvironment(example, options)
    want = render_prompt(engine.tokenizer, [{"role": "user", "content": "What is 6 * 7?"}],
                         env.tool_schemas())
    assert [r.tolist() for r in batch.ragged("prompt_ids").rows()] == [want, want]
    assert '"name": "calculator"' in engine.tokenizer.decode(want)
