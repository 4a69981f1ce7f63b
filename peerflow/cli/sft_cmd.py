"""`peerflow sft CONFIG --out DIR`: a short supervised warm start on a task's answers.

For tasks a tiny model cannot learn by RL from random initialisation, fine-tune the
config's model (`model.path`, or the one `model.builder` makes) on the task's
(prompt, answer) pairs with a plain torch loop in one process, and write a Hugging Face
model directory to use as `model.path` for the RL run. Prompts are encoded exactly as the
worker encodes them (the tokenizer's chat template), the loss covers the answer tokens
and the closing EOS only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from peerflow.cli.options import add_config_arguments

HELP = "supervised warm start on a task's (prompt, answer) pairs"
DESCRIPTION = ("Fine-tune the config's model on its task's answers (one process, plain torch) "
               "and write a Hugging Face model directory for model.path.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds CONFIG, `--set`, `--out` and the warm start's settings."""
    add_config_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="model directory to write")
    parser.add_argument("--steps", type=int, default=200, help="optimiser steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples a step (64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    parser.add_argument("--eval-examples", type=int, default=64, metavar="N",
                        help="greedy exact-match check on N eval examples at the end (0: skip)")


def run(args: argparse.Namespace) -> int:
    """Runs the warm start; prints a JSON summary."""
    from peerflow.config import load_config

    config = load_config(args.config, args.overrides)
    summary = supervised_warm_start(
        config, args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        eval_examples=args.eval_examples,
    )
    print(json.dumps(summary, indent=2))
    print(f"warm-started model written to {args.out}; train from it with "
          f"--set model.path={args.out}")
    return 0


def _collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for row, (prompt, answer) in enumerate(pairs):
        sequence = prompt + answer
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(prompt) : len(sequence)] = torch.tensor(answer)
        mask[row, : len(sequence)] = 1
    return ids, labels, mask


def supervised_warm_start(
    config: Any, out: str | Path, *, steps: int = 200, batch_size: int = 64, lr: float = 1e-3,
    eval_examples: int = 64, log: Any = print,
) -> dict[str, Any]:
    """Fine-tunes the config's model on its task's answers and saves it to `out`.

    Args:
        config: A `RunConfig` (model, task, seed and `runtime.torch_threads` are used).
        out: Directory to write (config, safetensors, tokenizer, `peerflow_sft.json`).
        steps: Optimiser steps.
        batch_size: Examples a step, read in the task's deterministic train order.
        lr: AdamW learning rate.
        eval_examples: Eval-split examples for a greedy exact-match check (0: skip).
        log: Called with a progress line every 10% of the steps.

    Returns:
        A summary: losses at the start and the end, eval exact match, seconds taken.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peerflow.hf_export import unique_tensors, write_model_dir
    from peerflow.plugins import get_plugin_manager
    from peerflow.rollout.prompts import encode_prompt
    from peerflow.worker.runtime import build_task, resolve_model_path

    torch.set_num_threads(config.runtime.torch_threads)
    torch.manual_seed(config.seed)
    pm = get_plugin_manager()
    task = build_task(config, pm)
    source = resolve_model_path(config, pm)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.train()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    examples = task.examples("train", config.seed)
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        pairs = []
        for _ in range(batch_size):
            example = next(examples, None)
            if example is None:
                examples = task.examples("train", config.seed + step)
                example = next(examples)
            answer = list(tokenizer(str(example.answer), add_special_tokens=False)["input_ids"])
            pairs.append((encode_prompt(tokenizer, example.prompt), answer + [eos]))
        ids, labels, mask = _collate(pairs, pad)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % max(1, steps // 10) == 0 or step == steps:
            log(f"sft step {step}/{steps} loss {losses[-1]:.4f}")
    model.eval()
    accuracy = _exact_match(model, tokenizer, task, eval_examples) if eval_examples else None
    out = Path(out)
    write_model_dir(out, unique_tensors(model), config=model.config, tokenizer=tokenizer,
                    generation_config=model.generation_config)
    summary = {
        "source_model": source, "task": config.task.name, "steps": steps,
        "batch_size": batch_size, "lr": lr, "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None, "eval_exact_match": accuracy,
        "eval_examples": eval_examples, "seconds": round(time.perf_counter() - started, 2),
    }
    (out / "peerflow_sft.json").write_text(json.dumps(summary, indent=1))
    return summary


def _exact_match(model: Any, tokenizer: Any, task: Any, count: int) -> float:
    """Greedy exact match of the model's answers on the first `count` eval examples."""
    import torch

    from peerflow.rollout.prompts import encode_prompt

    size = task.size("eval")
    count = min(count, size) if size is not None else count
    hits = 0
    with torch.inference_mode():
        for index in range(count):
            example = task.example("eval", index, 0)
            prompt = torch.tensor([encode_prompt(tokenizer, example.prompt)])
            answer = str(example.answer)
            output = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                max_new_tokens=len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 2,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            text = tokenizer.decode(output[0, prompt.shape[1]:], skip_special_tokens=True)
            hits += text.strip() == answer.strip()
    return hits / count if count else 0.0
