"""`peerflow sft`: a supervised warm start that lowers the loss and writes a model dir."""

from __future__ import annotations

import json

import pytest

from peerflow.cli import main


def test_sft_writes_a_loadable_model_and_learns(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("PEERFLOW_MODEL_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "run.yaml"
    config.write_text(
        "task:\n  name: arithmetic\n  options: {digits: 2, no_carry: true}\n"
        "model:\n  builder: arithmetic\n"
        "  builder_options: {hidden_size: 64, intermediate_size: 128}\n"
    )
    out = tmp_path / "warm"
    code = main(["sft", str(config), "--out", str(out), "--steps", "40", "--batch-size", "32",
                 "--lr", "3e-3", "--eval-examples", "4", "--set", "seed=1"])
    assert code == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "peerflow_sft.json").read_text())
    assert summary["steps"] == 40 and summary["task"] == "arithmetic"
    assert summary["loss_last"] < 0.6 * summary["loss_first"]
    assert 0.0 <= summary["eval_exact_match"] <= 1.0
    assert f"--set model.path={out}" in printed
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and tokenizer.chat_template


def test_sft_without_a_model_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("task:\n  name: reverse-digits\n")
    assert main(["sft", str(config), "--out", str(tmp_path / "o"), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "set model.path to a local Hugging Face model directory, or model.builder" in err
