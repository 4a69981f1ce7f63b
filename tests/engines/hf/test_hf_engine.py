"""The `hf` rollout engine: sampling settings, log-probs, weights, registration."""

from __future__ import annotations

import pytest
import torch

from peerflow import GenerationRequest, ParallelLayout, SamplingParams
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError

PROMPTS = ["12+3=", "abc", "hello world", "7-2=", "the answer is"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    return HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout(), seed=5))


@pytest.fixture(scope="module")
def requests_(engine):
    tok = engine.tokenizer
    return [GenerationRequest(request_id=10 + i, prompt_ids=tok(p).input_ids)
            for i, p in enumerate(PROMPTS)]


def _fresh_logprobs(model, prompt, tokens, temperature=1.0):
    """Log-probs of `tokens` after `prompt` from one unpadded forward pass."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    lp = (logits / temperature).log_softmax(-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_registered_through_the_plugin_hooks(plugin_manager):
    from peerflow.adapters.hf.engine import HFRolloutEngine, HFRolloutOptions

    assert plugin_manager.get("rollout_engine", "hf") is HFRolloutEngine
    assert HFRolloutEngine.options_class is HFRolloutOptions
    assert HFRolloutEngine.capabilities.logprobs and HFRolloutEngine.capabilities.stop_strings


def test_greedy_equals_transformers_generate(engine, requests_):
    # Prompts of different lengths share one left-padded batch.
    results = engine.generate(requests_, SamplingParams(temperature=0, max_tokens=12))
    assert [r.request_id for r in results] == [r.request_id for r in requests_]
    for req, res in zip(requests_, results, strict=True):
        ids = torch.tensor([req.prompt_ids])
        out = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                    do_sample=False)
        assert list(res.token_ids) == out[0, ids.shape[1]:].tolist()


def test_batch_split_does_not_change_greedy_answers(tiny_model, engine, requests_):
    from peerflow.adapters.hf.engine import HFRolloutEngine, HFRolloutOptions

    small = HFRolloutEngine(
        EngineContext(model_path=tiny_model, layout=ParallelLayout()),
        HFRolloutOptions(max_batch_size=2),
    )
    params = SamplingParams(temperature=0, max_tokens=10)
    one = engine.generate(requests_, params)
    split = small.generate(requests_, params)
    assert [r.token_ids for r in one] == [r.token_ids for r in split]


def test_n_samples_max_tokens_and_finish_reasons(engine, requests_):
    results = engine.generate(requests_, SamplingParams(n=3, max_tokens=7, seed=1))
    assert len(results) == 3 * len(requests_)
    assert [(r.request_id, r.index) for r in results] == [
        (q.request_id, j) for q in requests_ for j in range(3)
    ]
    eos = engine.eos_token_ids
    reasons = set()
    for r in results:
        assert 1 <= len(r.token_ids) <= 7 and len(r.logprobs) == len(r.token_ids)
        ended_on_eos = r.token_ids[-1] in eos
        assert r.finish_reason == ("stop" if ended_on_eos else "length")
        assert not any(t in eos for t in r.token_ids[:-1])
        assert r.version_segments == ((0, 0),)
        reasons.add(r.finish_reason)
    assert reasons == {"stop", "length"}  # this tiny model both stops early and runs on


def test_sampled_logprobs_equal_a_fresh_forward_pass(engine, requests_):
    params = SamplingParams(n=2, max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=4)
    results = engine.generate(requests_, params)
    by_id = {q.request_id: q for q in requests_}
    worst = 0.0
    for r in results:
        expected = _fresh_logprobs(engine.model, by_id[r.request_id].prompt_ids, r.token_ids,
                                   temperature=0.8)
        worst = max(worst, float((torch.tensor(r.logprobs) - expected).abs().max()))
    print(f"max |batched KV-cache - fresh forward| log-prob = {worst:.2e}")
    assert worst < 1e-4


def test_logprobs_are_tempered_and_not_renormalised_by_top_k(engine, requests_):
    """The contract: log_softmax(logits / T) at the sampled token, top-k ignored."""
    results = engine.generate(requests_[:2], SamplingParams(max_tokens=6, temperature=0.7,
                                                            top_k=5, seed=2))
    for req, r in zip(requests_, results, strict=False):
        expected = _fresh_logprobs(engine.model, req.prompt_ids, r.token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-4)
        untempered = _fresh_logprobs(engine.model, req.prompt_ids, r.token_ids)
        assert not torch.allclose(torch.tensor(r.logprobs), untempered, atol=1e-2)


def test_first_token_frequencies_match_the_policy(engine, requests_):
    req = requests_[1]
    params = SamplingParams(n=4000, max_tokens=1, temperature=1.0, top_k=4, seed=7)
    results = engine.generate([req], params)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]),
                            minlength=engine.model.config.vocab_size).float()
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([req.prompt_ids])).logits[0, -1]
    top = torch.topk(logits, 4).indices
    assert counts.sum() == counts[top].sum()  # nothing outside the top-k is ever drawn
    probs = logits[top].softmax(-1)
    freqs = counts[top] / counts.sum()
    assert torch.allclose(freqs, probs, atol=0.03), (freqs, probs)


def test_top_k_1_and_tiny_top_p_are_greedy(engine, requests_):
    greedy = engine.generate(requests_, SamplingParams(temperature=0, max_tokens=8))
    top_k = engine.generate(requests_, SamplingParams(top_k=1, max_tokens=8, seed=3))
    top_p = engine.generate(requests_, SamplingParams(top_p=1e-6, max_tokens=8, seed=3))
    assert [r.token_ids for r in greedy] == [r.token_ids for r in top_k]
    assert [r.token_ids for r in greedy] == [r.token_ids for r in top_p]


def test_logprobs_can_be_switched_off(engine, requests_):
    results = engine.generate(requests_, SamplingParams(max_tokens=4, logprobs=False, seed=1))
    assert all(r.logprobs == () and len(r.token_ids) for r in results)


def test_seed_makes_sampling_reproducible(engine, requests_):
    params = SamplingParams(n=2, max_tokens=8, seed=11)
    first = engine.generate(requests_, params)
    again = engine.generate(requests_, params)
    other = engine.generate(requests_, SamplingParams(n=2, max_tokens=8, seed=12))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]


def _greedy_text(engine, request, max_tokens=12):
    (res,) = engine.generate([request], SamplingParams(temperature=0, max_tokens=max_tokens))
    return res, engine.tokenizer.decode(res.token_ids)


def test_stop_strings_end_the_sample_and_are_removed(engine, requests_):
    request = requests_[2]
    full, text = _greedy_text(engine, request)
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = text.find(stop)
    (res,) = engine.generate([request], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    assert res.finish_reason == "stop"
    assert engine.tokenizer.decode(res.token_ids) == text[:cut]
    assert list(res.logprobs) == list(full.logprobs[: len(res.token_ids)])


def test_stop_string_kept_when_asked(tiny_model, engine, requests_):
    from peerflow.adapters.hf.engine import HFRolloutEngine, HFRolloutOptions

    keep = HFRolloutEngine(
        EngineContext(model_path=tiny_model, layout=ParallelLayout()),
        HFRolloutOptions(include_stop_str_in_output=True),
    )
    request = requests_[2]
    _, text = _greedy_text(engine, request)
    stop = text[3:5]
    (res,) = keep.generate([request], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    assert keep.tokenizer.decode(res.token_ids) == text[: text.find(stop) + len(stop)]


def test_stop_token_ids_end_the_sample_and_are_kept(engine, requests_):
    request = requests_[2]
    full, _ = _greedy_text(engine, request)
    token = full.token_ids[4]
    first = full.token_ids.index(token)
    (res,) = engine.generate(
        [request], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token])
    )
    assert res.token_ids == full.token_ids[: first + 1]
    assert res.finish_reason == "stop"


def test_weight_targets_list_tied_embeddings_once(engine, tiny_untied_qwen):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    names = {s.local_name for s in engine.weight_targets()}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    untied = HFRolloutEngine(EngineContext(model_path=tiny_untied_qwen, layout=ParallelLayout()))
    specs = {s.local_name: s for s in untied.weight_targets()}
    assert "lm_head.weight" in specs
    assert "model.layers.0.self_attn.q_proj.bias" in specs  # qwen2 has qkv biases
    for name, param in untied.model.named_parameters():
        spec = specs[name]
        assert spec.local_shape == tuple(param.shape) and spec.replica == 0
        assert spec.pieces[0].global_shape == tuple(param.shape)


def test_load_weights_updates_in_place_and_publishes_the_version(tiny_model, requests_):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout()))
    specs = engine.weight_targets()
    before = engine.generate(requests_, SamplingParams(temperature=0, max_tokens=6))
    storage = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    new = [(s, torch.randn(s.local_shape, generator=gen) * 0.3) for s in specs]
    engine.begin_weight_update(7)
    assert engine.weight_version == 0  # not published until the update finishes
    engine.load_weights(new[:3])
    engine.load_weights(new[3:])
    engine.finish_weight_update()
    assert engine.weight_version == 7
    params = dict(engine.model.named_parameters())
    for spec, tensor in new:
        assert torch.equal(params[spec.local_name].data, tensor)
        assert params[spec.local_name].data_ptr() == storage[spec.local_name]
    assert torch.equal(engine.model.lm_head.weight, params["model.embed_tokens.weight"])
    after = engine.generate(requests_, SamplingParams(temperature=0, max_tokens=6))
    assert [r.token_ids for r in before] != [r.token_ids for r in after]
    assert all(r.version_segments == ((0, 7),) for r in after)
    # Nothing computed under version 0 (a prompt's cached keys and values) is reused: the
    # same prompts' log-probs are those of a fresh forward pass with the new weights.
    for req, res in zip(requests_, after, strict=True):
        fresh = _fresh_logprobs(engine.model, req.prompt_ids, res.token_ids)
        assert float((torch.tensor(res.logprobs) - fresh).abs().max()) < 1e-4


def test_bad_input_is_a_clear_error(engine, requests_):
    spec = engine.weight_targets()[0]
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.load_weights([(spec.__class__.of_slice("nope", (2,)), torch.zeros(2))])
    with pytest.raises(ValueError, match="expected"):
        engine.load_weights([(spec, torch.zeros(3))])
    with pytest.raises(ValueError, match="empty string"):
        engine.generate(requests_, SamplingParams(stop=[""]))
    with pytest.raises(ValueError, match="no prompt tokens"):
        engine.generate([GenerationRequest(request_id=0, prompt_ids=())], SamplingParams())
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        engine.generate(requests_, SamplingParams(max_tokens=1000))


def test_tensor_parallel_layout_is_rejected(tiny_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    with pytest.raises(ConfigError, match="rollout.layout.tp"):
        HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout(tp=2)))


def test_weight_buffers_are_the_live_parameters(tiny_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout()))
    specs = engine.weight_targets()
    engine.begin_weight_update(3)
    buffers = engine.weight_buffers(specs)
    for buf in buffers:
        buf.fill_(0.25)
    engine.load_weights(list(zip(specs, buffers, strict=True)))
    engine.finish_weight_update()
    assert all(bool((p == 0.25).all()) for p in engine.model.parameters())
    assert engine.weight_version == 3
