"""The terminal: step and evaluation lines, the end-of-run summary, library bars off."""

from __future__ import annotations

import os

import pytest

from peerflow.outputs import StepProgress
from peerflow.outputs.console import eval_line, run_summary, step_line

STEP = {
    "reward/mean": 0.4237, "reward/std": 0.3112, "reward/correct/mean": 0.35,
    "reward/format/mean": 0.9, "reward/errors": 0.0, "reward/frac_zero_std": 0.25,
    "actor/loss": -0.01234, "actor/pg_loss": -0.02, "actor/grad_norm": 0.8312,
    "kl/mean": 0.00213, "actor/entropy": 1.234, "response_length/mean": 31.6,
    "throughput/tokens_per_s": 16420.0, "time/step": 0.853, "actor/lr": 1e-6,
}


def test_step_line_shows_what_rl_users_watch():
    line = step_line(3, 100, STEP)
    assert line == ("step   3/100  reward 0.424±0.31 (correct 0.35, format 0.9)  "
                    "loss -0.0123  grad 0.831  kl 0.00213  entropy 1.23  len 31.6  "
                    "16.4k tok/s  0.853s")
    # KL only with a KL term, components only with several rewards; async adds staleness
    plain = {k: v for k, v in STEP.items() if k not in ("kl/mean", "reward/format/mean")}
    plain["staleness/mean"] = 0.5
    line = step_line(7, 9, plain)
    assert " kl " not in line and "correct" not in line and "staleness 0.5" in line
    assert line.startswith("step 7/9  reward 0.424±0.31  loss -0.0123")
    ppo = {"reward/mean": 1.0, "actor/pg_loss": 0.5, "critic/vf_loss": 0.25,
           "actor/grad_norm": float("nan")}
    assert step_line(1, 1, ppo) == "step 1/1  reward 1  loss 0.5  vf_loss 0.25"


def test_eval_line():
    metrics = {"eval/greedy/reward": 0.25, "eval/sampled/reward": 0.1875, "eval/pass@1": 0.19,
               "eval/pass@4": 0.5, "eval/pass@2": 0.31, "eval/greedy/response_length": 3.5,
               "eval/prompts": 16}
    assert eval_line(20, 100, metrics) == ("eval  20/100  greedy 0.25  sampled 0.188  "
                                           "pass@1 0.19  pass@2 0.31  pass@4 0.5  len 3.5")


def _records():
    records = [{"step": 0, "eval/greedy/reward": 0.05, "eval/pass@2": 0.1}]
    rewards = [0.1, 0.1, 0.2, 0.1, 0.0, 0.5, 0.6, 0.7, 0.5, 0.5, 0.6, 0.5]
    records += [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]
    records[-1] |= {"eval/greedy/reward": 0.52, "eval/pass@2": 0.71}
    return records


def test_run_summary_says_how_it_went_where_things_are_and_what_next(tmp_path):
    (tmp_path / "samples").mkdir()
    checkpoint = str(tmp_path / "checkpoints" / "step_000012")
    text = run_summary(tmp_path, _records(), step=12, total=12, seconds=192.4, mode="async",
                       checkpoint=checkpoint, trackers=["tensorboard --logdir x/tb"])
    lines = text.splitlines()
    assert lines[0] == f"peerflow: run finished 12 steps in 3m 12s (async mode): {tmp_path}"
    assert ("  reward     0.1 → 0.56 (means of the first and last 5 logged steps; "
            "best 0.7 at step 8)") in lines
    assert "  eval       greedy reward 0.05 → 0.52, pass@2 0.71 (step 0 → 12)" in lines
    assert f"  checkpoint {checkpoint}" in lines and f"  samples    {tmp_path}/samples" in lines
    assert "  tracker    tensorboard --logdir x/tb" in lines
    assert lines[lines.index("next:") + 1:] == [
        f"  peerflow samples {tmp_path} --worst  # the answers with the lowest reward",
        f"  peerflow report {tmp_path}           # plots and summary.json under report/",
        f"  peerflow export {tmp_path} OUT_DIR   # the checkpoint as a Hugging Face model "
        "directory",
    ]
    stopped = run_summary(tmp_path / "other", _records()[:4], step=3, total=12, seconds=5.0,
                          mode="sync")
    assert stopped.startswith("peerflow: run stopped after step 3 of 12 steps in 5.0 s")
    assert "checkpoint none written" in stopped and "peerflow export" not in stopped
    assert f"peerflow train --resume {tmp_path / 'other'}" in stopped
    resumed = run_summary(tmp_path, _records(), step=12, total=12, seconds=5.0, mode="sync",
                          start=6)
    assert resumed.startswith("peerflow: run finished 12 steps in 5.0 s (sync mode, resumed "
                              "at step 6): ")


def test_progress_prints_step_eval_and_summary_lines(capsys):
    with StepProgress(4, live=False) as bar:
        bar.update(0, {"eval/greedy/reward": 0.0})  # the evaluation before step 1
        bar.update(1, STEP, line=False)  # not a logged step: the bar moves, no line
        bar.update(2, STEP | {"eval/greedy/reward": 0.5})
        bar.print("summary")
    err = capsys.readouterr().err.splitlines()
    assert err == ["eval 0/4  greedy 0", step_line(2, 4, STEP), "eval 2/4  greedy 0.5", "summary"]
    with StepProgress(9, start=5, live=False) as resumed:  # its first evaluation: no step line
        resumed.update(5, {"step": 5, "eval/greedy/reward": 0.5})
    assert capsys.readouterr().err.splitlines() == ["eval 5/9  greedy 0.5"]
    with StepProgress(2, live=True) as live:  # lines print above the rich bar
        live.update(1, STEP)
    assert step_line(1, 2, STEP) in capsys.readouterr().err


def test_worker_start_up_switches_library_progress_bars_off(monkeypatch, capfd):
    import torch
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    from peerflow.outputs.progress import quiet_library_progress
    from peerflow.worker import main

    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS",
                 "GLOO_SOCKET_IFNAME", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE",
                 "OMP_NUM_THREADS"):  # restored afterwards, like the torch threads
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    transformers_logging.enable_progress_bar()
    try:
        for _ in transformers_logging.tqdm(range(3), desc="Loading weights"):
            pass
        assert "Loading weights" in capfd.readouterr().err  # drawn before
        main._environment()  # what every worker runs first
        for _ in transformers_logging.tqdm(range(3), desc="Loading weights"):
            pass
        assert capfd.readouterr().err == ""
        assert are_progress_bars_disabled() and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's choice stays
        transformers_logging.enable_progress_bar()
        quiet_library_progress()
        assert transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()
        enable_progress_bars()


@pytest.mark.parametrize("seconds, text", [(0.24, "0.2 s"), (59.9, "59.9 s"),
                                           (3725, "1h 02m")])
def test_durations(seconds, text):
    from peerflow.outputs.console import _duration

    assert _duration(seconds) == text
