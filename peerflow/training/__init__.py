"""The training toolkit every train adapter builds on (fsdp, deepspeed, megatron).

`CausalLMTrainEngine` implements the `TrainEngine` contract once — mini-batches ×
token-balanced micro-batches, global token counts, log-probs and entropy at the sampling
temperature, the one host/device crossing of a micro-batch and of its results, the
step's metrics — over an adapter's forward, backward and optimiser step. The pieces are
usable on their own.
"""

from peerflow.training.collectives import (
    all_reduce_max,
    all_reduce_sum,
    check_layout_spans_world,
    global_counts,
)
from peerflow.training.dtypes import torch_dtype
from peerflow.training.engine import CausalLMTrainEngine, MicroBatch, Objective
from peerflow.training.inputs import PaddedInputs, gather_results, pad_inputs, pad_to_shape
from peerflow.training.logprobs import VocabShard, tempered, token_entropy, token_logprobs
from peerflow.training.metrics import StepTally
from peerflow.training.microbatch import (
    fixed_shape_micro_batches,
    pack_by_tokens,
    plan_micro_batches,
    split_mini_batches,
    split_to_count,
)
from peerflow.training.optim import build_adamw
from peerflow.training.schedule import build_lr_scheduler

__all__ = [
    "CausalLMTrainEngine",
    "MicroBatch",
    "Objective",
    "PaddedInputs",
    "StepTally",
    "VocabShard",
    "all_reduce_max",
    "all_reduce_sum",
    "check_layout_spans_world",
    "build_adamw",
    "build_lr_scheduler",
    "fixed_shape_micro_batches",
    "gather_results",
    "global_counts",
    "pack_by_tokens",
    "pad_inputs",
    "pad_to_shape",
    "plan_micro_batches",
    "split_mini_batches",
    "split_to_count",
    "tempered",
    "token_entropy",
    "token_logprobs",
    "torch_dtype",
]
