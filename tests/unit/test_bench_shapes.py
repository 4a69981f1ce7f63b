"""The benchmarks' shapes: the realistic config, the bench model and its answer lengths.

No timing here: these check what the shapes build (model size, vocabulary, the EOS
probability that makes lengths geometric, prompt lengths, the config overrides) and the
length summary. Figures come from `peerflow bench … --shape realistic`.
"""

from __future__ import annotations

import argparse

import pytest

from peerflow.bench import shapes
from peerflow.config import load_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_realistic_overrides_turn_the_quickstart_into_the_realistic_shape():
    from peerflow.contrib.tasks.generated import ReverseDigitsTask

    assert shapes.config_overrides("quickstart") == []
    config = load_config("examples/quickstart.yaml", shapes.config_overrides("realistic"))
    assert config.rollout.sampling.max_tokens == shapes.MAX_TOKENS == 512
    assert config.model.builder == "reverse-digits" and config.task.options["digits"] == 127
    options = dict(config.model.builder_options)
    assert options["hidden_size"] == 768 and options["num_layers"] == 8
    assert options["tie_word_embeddings"] is False and options["reserved_tokens"] == 110
    assert ReverseDigitsTask.check_builder_options(options) == []
    task = ReverseDigitsTask(ReverseDigitsTask.options_class(digits=127))
    assert len(task.example("train", 0, seed=0).prompt) == shapes.PROMPT_TOKENS == 128


def test_bench_model_has_at_least_50m_parameters():
    from transformers import AutoConfig, AutoModelForCausalLM

    opts = shapes.BENCH_MODEL
    config = AutoConfig.for_model(
        "llama", vocab_size=18 + opts["reserved_tokens"], hidden_size=opts["hidden_size"],
        intermediate_size=opts["intermediate_size"], num_hidden_layers=opts["num_layers"],
        num_attention_heads=opts["num_heads"], num_key_value_heads=opts["num_kv_heads"],
        tie_word_embeddings=opts["tie_word_embeddings"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) >= 50_000_000
    # Answers up to the cap fit behind a realistic prompt (and its BOS).
    assert opts["max_position_embeddings"] >= shapes.PROMPT_TOKENS + 1 + shapes.MAX_TOKENS


def test_reserved_tokens_and_small_init_give_eos_near_one_over_vocab(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The bench model's vocabulary and initialisation on a narrow, shallow body.
    path = shapes.build_model(tmp_path, {"hidden_size": 64, "intermediate_size": 128,
                                         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2})
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    vocab = 18 + shapes.BENCH_MODEL["reserved_tokens"]  # 4 special + 14 task characters
    assert len(tokenizer) == model.config.vocab_size == vocab
    assert not model.config.tie_word_embeddings
    reserved = tokenizer.convert_tokens_to_ids("<reserved_0>")
    assert tokenizer.decode([reserved]) == "<reserved_0>"  # decodable, not dropped
    prompts = shapes.prompt_ids(path, count=3, length=40, seed=1)
    assert [len(p) for p in prompts] == [40, 40, 40]
    assert prompts[0] != prompts[1]
    ids = torch.tensor([prompts[0][:20] + [reserved] * 5 + prompts[1][:15]])
    with torch.no_grad():
        probs = model(ids).logits.softmax(-1)[0, :, tokenizer.eos_token_id]
    # Every position: EOS about 1/vocab, so lengths are geometric with mean ≈ vocab.
    assert probs.min() > 0.8 / vocab and probs.max() < 1.25 / vocab


def test_default_options_keep_their_cache_key():
    import hashlib
    import json

    import attrs

    from peerflow.contrib.tasks.tiny_model import BUILDER_VERSION, TinyModelOptions, cache_key

    options = TinyModelOptions()
    old = {k: v for k, v in attrs.asdict(options).items()
           if k not in ("reserved_tokens", "vocab_size", "initializer_range", "num_experts",
                        "num_experts_per_tok", "moe_intermediate_size")}
    payload = json.dumps({"builder": "digits", "version": BUILDER_VERSION,
                          "corpus": ["0123"], "options": old}, sort_keys=True)
    assert cache_key("digits", ["0123"], options) == hashlib.sha256(
        payload.encode()).hexdigest()[:16]
    assert cache_key("digits", ["0123"], TinyModelOptions(reserved_tokens=3)) != cache_key(
        "digits", ["0123"], options)
    with pytest.raises(ValueError, match="reserved_tokens=-1"):
        TinyModelOptions(reserved_tokens=-1)


def test_length_stats_on_a_long_tail():
    lengths = [3, 5, 8, 12, 20, 40, 90, 512, 512, 7]
    stats = shapes.length_stats(lengths, cap=512)
    assert stats["count"] == 10 and stats["max"] == 512
    assert stats["mean"] == pytest.approx(sum(lengths) / 10)
    assert stats["median"] == pytest.approx(16.0)
    assert stats["p90"] == 512 and stats["capped_fraction"] == pytest.approx(0.2)
    assert shapes.length_stats([], cap=4)["count"] == 0


def test_shape_argument_and_pick():
    parser = argparse.ArgumentParser()
    shapes.add_shape_argument(parser)
    assert parser.parse_args([]).shape == "quickstart"
    assert parser.parse_args(["--shape", "realistic"]).shape == "realistic"
    with pytest.raises(SystemExit):
        parser.parse_args(["--shape", "huge"])
    assert shapes.pick(None, "realistic", 8, 2) == 2
    assert shapes.pick(None, "quickstart", 8, 2) == 8
    assert shapes.pick(5, "realistic", 8, 2) == 5
