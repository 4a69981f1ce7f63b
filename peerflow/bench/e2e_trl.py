"""TRL side of `peerflow bench e2e`: the same GRPO run through TRL's `GRPOTrainer`.

Run as a module under torchrun, one process per rank (TRL uses `accelerate`, which reads
the torchrun environment):

    torchrun --nproc-per-node 2 -m peerflow.bench.e2e_trl --config CFG --out FILE ...

It reads the same run config as PeerFlow, resolves the same model directory (so both
start from identical weights), gives TRL the prompts PeerFlow's sampler would draw, scores
answers with the same registered reward, and writes `{"tokens", "train_s"}` on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> None:
    """Runs TRL GRPO for the config's steps and writes the token count and wall time."""
    parser = argparse.ArgumentParser(prog="python -m peerflow.bench.e2e_trl")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from peerflow.config import load_config
    from peerflow.plugins import load_plugins
    from peerflow.rewards.setup import build_reward_set
    from peerflow.worker.runtime import build_components, resolve_model_path

    config = load_config(args.config, args.overrides)
    pm = load_plugins()
    model_path = resolve_model_path(config, pm)
    components = build_components(config, pm)
    task = components["task"]
    reward = build_reward_set(config.task, pm, components["default_reward"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prompts_per_step = config.run.prompts_per_step
    examples = {}
    for i, example in enumerate(task.examples("train", config.seed)):
        if i >= prompts_per_step * config.run.steps:
            break
        examples[i] = example
    # One user message per prompt, like PeerFlow's `encode_prompt`: TRL then renders the
    # tokenizer's chat template too, so both sides train on the same token sequences.
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": e.prompt}] for e in examples.values()],
        "example_index": list(examples),
    })

    def reward_fn(completions: list, example_index: list, **_: object) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        scores = reward.score(texts, [examples[int(i)] for i in example_index])
        return [float(x) for x in scores.total]

    reward_fn.__name__ = "reward"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trl_args = _grpo_config(config, Path(args.workdir) / "trl", world)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=trl_args,
                          train_dataset=dataset, processing_class=tokenizer)
    loop = _loop_clock()
    trainer.add_callback(loop)
    generate_s = _time_generation(trainer)
    trainer.train()
    train_s = time.perf_counter() - loop.start
    if int(os.environ.get("RANK", "0")) == 0:
        rewards = [h.get("reward") for h in trainer.state.log_history if "reward" in h]
        Path(args.out).write_text(json.dumps({
            "tokens": float(trainer.state.num_input_tokens_seen),
            "train_s": train_s,
            "steps": trainer.state.global_step,
            "reward": rewards,
            **{key.split("/")[1]: [h[key] for h in trainer.state.log_history if key in h]
               for key in ("completions/mean_length", "completions/max_length",
                           "completions/clipped_ratio")},
            "generate_s": generate_s,
        }))


def _time_generation(trainer: Any) -> list[float]:
    """Times each call of the trainer's `_generate` (sampling and decoding the answers).

    Returns the list the times are appended to (this rank's, in seconds).
    """
    times: list[float] = []
    generate = trainer._generate

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    trainer._generate = timed
    return times


def _loop_clock() -> Any:
    """A callback noting when TRL's first step begins (its `start`, a `perf_counter` time).

    `trainer.train()` first builds the optimiser and wraps the model, which PeerFlow does
    before its loop; timing from the first step makes both loops the same span.
    """
    from transformers import TrainerCallback

    class LoopClock(TrainerCallback):
        start: float | None = None

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if self.start is None:
                self.start = time.perf_counter()

    return LoopClock()


def _grpo_config(config: Any, output_dir: Path, world: int) -> Any:
    """Returns TRL's `GRPOConfig` with the PeerFlow config's sampling and optimiser settings."""
    from trl import GRPOConfig

    sampling = config.rollout.sampling
    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=config.run.prompts_per_step * sampling.n // world,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=sampling.n,
        max_completion_length=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,  # 0: off (None would let transformers apply its top-k 50)
        learning_rate=config.trainer.lr,
        adam_beta1=config.trainer.betas[0],
        adam_beta2=config.trainer.betas[1],
        weight_decay=config.trainer.weight_decay,
        max_grad_norm=config.trainer.grad_clip,
        # GRPOConfig turns recomputation on by default; PeerFlow's trainer recomputes only
        # under trainer.activation_checkpointing: the same work on both sides.
        gradient_checkpointing=config.trainer.activation_checkpointing,
        # PeerFlow's schedule (peerflow.training.schedule) in transformers' names
        lr_scheduler_type={"constant": "constant_with_warmup", "linear": "linear",
                           "cosine": "cosine_with_min_lr"}[config.trainer.lr_schedule],
        lr_scheduler_kwargs=({"min_lr_rate": config.trainer.min_lr_ratio}
                             if config.trainer.lr_schedule == "cosine" else {}),
        warmup_steps=config.trainer.optim_settings(steps=config.run.steps).warmup_steps,
        beta=config.algorithm.kl.coef,
        max_steps=config.run.steps,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=config.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


if __name__ == "__main__":
    main()
