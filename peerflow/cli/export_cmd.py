"""`peerflow export RUN_DIR OUT_DIR`: a run's checkpoint as a Hugging Face model directory.

    peerflow export RUN_DIR OUT_DIR [--step N] [--dtype auto|float32|bfloat16|float16]
                                    [--max-shard-size 5GB] [--lora adapter|merged]
                                    [--trust-checkpoint]

The newest checkpoint that verifies (or `--step N`), from any train adapter and layout,
written as safetensors (sharded with an index past `--max-shard-size`), config,
generation config, tokenizer and chat template: what `transformers`,
vLLM or SGLang load with `from_pretrained(OUT_DIR)`. See `peerflow.hf_export`. A
checkpoint file that is a pickle the safe loader refuses is refused, naming the file,
unless `--trust-checkpoint` is given (`peerflow.checkpoint.pickles`).
"""

from __future__ import annotations

import argparse

from peerflow.cli.options import add_run_dir_argument, add_trust_checkpoint_argument, apply_trust
from peerflow.hf_export.run import DTYPES

HELP = "write a run's checkpoint as a Hugging Face model directory"
DESCRIPTION = ("Write the newest verified checkpoint of RUN_DIR (or --step N) as a Hugging "
               "Face model directory (safetensors, config, generation config, tokenizer, chat "
               "template) that transformers, vLLM and SGLang load. The weights are assembled "
               "in this process (one full host copy of the model).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds RUN_DIR, OUT_DIR, `--step`, `--dtype`, `--lora`, `--max-shard-size` and more."""
    add_run_dir_argument(
        parser, "a run directory (or one of its checkpoints/step_N directories)")
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="the model directory to create (must not exist, or be empty)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="the checkpoint of step N (default: the newest verified one)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="dtype of the written weights (default auto: as the checkpoint "
                        "holds them)")
    parser.add_argument("--lora", choices=("adapter", "merged"), default="adapter",
                        help="a trainer.lora run: write the adapter in peft's format "
                        "(default) or the base model with the adapters merged in")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file before the weights are split into "
                        "shards with an index (default 5GB)")
    add_trust_checkpoint_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Exports; prints where the model went and how to load it."""
    from peerflow.hf_export import export

    apply_trust(args)
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    result = export(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype,
                    max_shard_size=size, lora=args.lora)
    print(f"exported step {result.step} of {args.run_dir} ({result.backend} checkpoint, "
          f"{result.parameters:,} parameters, {result.dtype}) to {result.out_dir}")
    if (result.out_dir / "adapter_config.json").is_file():
        print(f"a LoRA adapter (peft): PeftModel.from_pretrained(base_model, "
              f"{str(result.out_dir)!r}), or vllm serve BASE --enable-lora --lora-modules "
              f"policy={result.out_dir}")
        return 0
    print(f"load it with AutoModelForCausalLM.from_pretrained({str(result.out_dir)!r}), or "
          f"serve it: vllm serve {result.out_dir}")
    return 0
