"""The fsdp trainer at temperature ≠ 1: its update at T = 0.6 is the hand-computed gradient.

A two-step "tree" with a four-token vocabulary, on a real HF model the fsdp engine loads:
a Llama with no transformer block, identity embeddings and an untied output layer, so the
logits after token `s` are `W[:, s] * h_s` (`h_s` the RMS-normalised one-hot) — a
tabular softmax policy whose column `s` belongs to state `s` alone. The batch holds every
two-token answer `y = (y1, y2)` to the prompt, weighted by its exact probability under
`softmax(logits / T)`, so one step of PPO (ratio 1) takes the *expected* policy gradient

    g = -E_{y ~ pi_T}[ A(y) * sum_t grad log pi_T(y_t | s_t) ],
    d log pi_T(k | s) / d z_s = (e_k - pi_T(. | s)) / T,   z_s = W[:, s] * h_s,

with `A = r - E[r]`. Only the likeliest answer is rewarded; a first token `y1` it does not
start with opens an unrewarded branch, whose state's column must not move: its score terms
average to zero under the sampling distribution. A trainer scoring at T = 1 moves it
(`E_{pi_T}[e_k - pi_1] = pi_T - pi_1`).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from peerflow import ParallelLayout
from peerflow.batch import Batch, RaggedField
from peerflow.engines import EngineContext, OptimSettings

VOCAB = 4
PROMPT = 3
TEMPERATURE = 0.6
LR, EPS = 1e-2, 1.0  # AdamW's first step: delta = -lr * g / (|g| + eps), exactly


@pytest.fixture(scope="module")
def tabular_model(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=VOCAB, intermediate_size=8,
                         num_hidden_layers=0, num_attention_heads=1, num_key_value_heads=1,
                         tie_word_embeddings=False, max_position_embeddings=8)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
        model.lm_head.weight.copy_(torch.randn(VOCAB, VOCAB, generator=torch.Generator()
                                               .manual_seed(7)) * 0.8)
    path = tmp_path_factory.mktemp("tabular")
    model.save_pretrained(path)
    return str(path)


def _engine(model_path: str, temperature: float):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions

    context = EngineContext(model_path=model_path, layout=ParallelLayout(),
                            temperature=temperature)
    optim = OptimSettings(lr=LR, eps=EPS, grad_clip=0.0, weight_decay=0.0)
    return FSDPTrainEngine(context, FSDPTrainOptions(), optim)


def _hidden_scale(engine) -> torch.Tensor:  # [VOCAB]: h_s = scale_s * e_s
    model = engine.model.model
    with torch.no_grad():
        hidden = model.norm(model.embed_tokens(torch.arange(VOCAB)))
    return hidden.diagonal().double()


def _policy(weight: torch.Tensor, scale: torch.Tensor, temperature: float) -> torch.Tensor:
    """`pi_T(. | s)` as column `s` of a `[VOCAB, VOCAB]` matrix (float64)."""
    return torch.softmax(weight.double() * scale[None, :] / temperature, dim=0)


def _tree(pi: torch.Tensor) -> tuple[tuple[int, int], int]:
    """The rewarded answer (the likeliest) and a state only an unrewarded branch visits."""
    first = int(pi[:, PROMPT].argmax())
    unrewarded = next(s for s in range(VOCAB) if s not in (first, PROMPT))
    return (first, int(pi[:, first].argmax())), unrewarded


def _tree_batch(pi: torch.Tensor) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """Every answer `(y1, y2)`, with PPO fields making one step the expected gradient.

    Returns:
        The batch, the answer probabilities `P(y)` and advantages `A(y)`.
    """
    answers = list(itertools.product(range(VOCAB), repeat=2))
    prob = torch.tensor([pi[y1, PROMPT] * pi[y2, y1] for y1, y2 in answers])
    rewarded, _ = _tree(pi)
    reward = torch.tensor([float(a == rewarded) for a in answers], dtype=torch.float64)
    advantage = reward - (prob * reward).sum()
    tokens = 2 * len(answers)  # token-mean divides by this; the advantages undo it
    logp = [torch.stack([pi[y1, PROMPT], pi[y2, y1]]).log() for y1, y2 in answers]
    batch = Batch(sample_id=range(len(answers)), group_id=[0] * len(answers),
                  weight_version=[0] * len(answers))
    batch.set("prompt_ids", [torch.tensor([PROMPT]) for _ in answers])
    batch.set("response_ids", [torch.tensor(a) for a in answers])
    batch.set("advantages", [torch.full((2,), float(tokens * p * a)) for p, a in
                             zip(prob, advantage, strict=True)])
    batch.set("old_logprobs", RaggedField.from_tensors([lp.float() for lp in logp]))
    batch.set("rollout_logprobs", RaggedField.from_tensors([lp.float() for lp in logp]))
    return batch, prob, advantage


def _expected_gradient(pi_score: torch.Tensor, prob: torch.Tensor, advantage: torch.Tensor,
                       scale: torch.Tensor, temperature: float) -> torch.Tensor:
    """`dL/dW` of `L = -sum_y P(y) A(y) sum_t log pi(y_t | s_t)`, term by term.

    `pi_score` is the policy inside the score function (`pi_T` for a correct trainer).
    """
    grad = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    answers = list(itertools.product(range(VOCAB), repeat=2))
    for (y1, y2), p, a in zip(answers, prob, advantage, strict=True):
        for state, token in ((PROMPT, y1), (y1, y2)):
            d_logits = (torch.nn.functional.one_hot(torch.tensor(token), VOCAB).double()
                        - pi_score[:, state]) / temperature
            grad[:, state] -= p * a * d_logits * scale[state]
    return grad


def _step(engine, batch) -> torch.Tensor:
    from peerflow.algorithms.losses import PPOClip, PPOClipOptions

    before = engine.model.lm_head.weight.detach().clone().double()
    metrics = engine.train_step(batch, PPOClip(PPOClipOptions(aggregation="token-mean")))
    assert metrics["actor/clipfrac"] == 0.0
    return engine.model.lm_head.weight.detach().double() - before


def _adam_first_step(grad: torch.Tensor) -> torch.Tensor:
    return -LR * grad / (grad.abs() + EPS)


def test_update_at_t06_is_the_hand_computed_policy_gradient(tabular_model):
    engine = _engine(tabular_model, TEMPERATURE)
    scale = _hidden_scale(engine)
    pi = _policy(engine.model.lm_head.weight.detach(), scale, TEMPERATURE)
    batch, prob, advantage = _tree_batch(pi)
    assert float(prob.sum()) == pytest.approx(1.0, abs=1e-12)
    got = engine.forward_logprobs(batch)  # the trainer scores the sampling distribution
    torch.testing.assert_close(got.values, batch["old_logprobs"].values, atol=1e-6, rtol=0)

    expected = _expected_gradient(pi, prob, advantage, scale, TEMPERATURE)
    delta = _step(engine, batch)
    torch.testing.assert_close(delta, _adam_first_step(expected), atol=2e-7, rtol=1e-4)
    (first, _), unrewarded = _tree(pi)
    assert expected[:, first].abs().max() > 1e-2, "the rewarded branch's state must move"
    assert expected[:, unrewarded].abs().max() < 1e-12
    assert delta[:, unrewarded].abs().max() < 1e-8, "the unrewarded branch moved"


def test_a_trainer_at_t1_moves_the_unrewarded_branch(tabular_model):
    """The bug this guards against: samples from pi_0.6, log-probs at T = 1."""
    engine = _engine(tabular_model, 1.0)
    scale = _hidden_scale(engine)
    weight = engine.model.lm_head.weight.detach()
    pi_sampled, pi_scored = _policy(weight, scale, TEMPERATURE), _policy(weight, scale, 1.0)
    batch, prob, advantage = _tree_batch(pi_sampled)
    batch.set("old_logprobs", engine.forward_logprobs(batch))  # ratio 1 at T = 1
    batch.set("rollout_logprobs", batch["old_logprobs"])
    delta = _step(engine, batch)
    biased = _expected_gradient(pi_scored, prob, advantage, scale, 1.0)
    torch.testing.assert_close(delta, _adam_first_step(biased), atol=2e-7, rtol=1e-4)
    _, unrewarded = _tree(pi_sampled)
    assert biased[:, unrewarded].abs().max() > 1e-4
    assert delta[:, unrewarded].abs().max() > 100 * 1e-8  # the tempered trainer's bound


def test_trainer_and_rollout_agree_at_t07_with_top_p_and_top_k(tiny_model):
    """Both sides report the tempered, untruncated log-prob of every sampled token."""
    from peerflow import GenerationRequest, SamplingParams
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from tests.engines.fsdp.fsdp_testlib import to_batch

    rollout = HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout()))
    requests = [GenerationRequest(request_id=i, prompt_ids=rollout.tokenizer(p).input_ids)
                for i, p in enumerate(["12+3=", "hello world", "zz"])]
    sampling = SamplingParams(n=3, max_tokens=10, temperature=0.7, top_p=0.8, top_k=12, seed=5)
    results = rollout.generate(requests, sampling)
    batch = to_batch(requests, results)
    sampled = torch.cat([torch.tensor(r.logprobs) for r in results])
    tempered = _engine(tiny_model, 0.7).forward_logprobs(batch).values
    torch.testing.assert_close(tempered, sampled, atol=1e-5, rtol=0)
    untempered = _engine(tiny_model, 1.0).forward_logprobs(batch).values
    assert (untempered - sampled).abs().max() > 1e-2
