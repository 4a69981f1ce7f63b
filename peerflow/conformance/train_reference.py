"""The train layer's fixed RL batch and the update a correct train engine must make on it.

The batch looks like a GRPO step: two prompts with four answers each of ragged lengths,
sampled at T = 0.7, group-relative advantages of both signs, and old log-probs that are
stale (the reference's own, moved by up to ±0.3 per token, so some ratios are clipped).
`OPTIM` splits it into two mini-batches of more than one micro-batch each.

The reference is what the contract says a train step is, written plainly: a
`transformers` model, one forward per sample, `log_softmax(logits / T)`, the loss on the
whole mini-batch with its global counts, autograd, `clip_grad_norm_` and
`torch.optim.AdamW` with the run's settings. It runs along the numerical paths of
`peerflow.conformance.tolerance` (float64, float32 eager, float32 SDPA): float64 is what
engines are compared with; the float32 paths give the reference's own spread, from which
each tolerance follows (`FACTOR` × spread, with a floor), so the layer holds on any CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from peerflow.algorithms.losses import PPOClip
from peerflow.batch import Batch, RaggedField
from peerflow.conformance.reference import module_tensors, reference_logprobs
from peerflow.conformance.tolerance import FACTOR, FLOOR, PATHS
from peerflow.engines.settings import OptimSettings
from peerflow.models import hf_parameters
from peerflow.training.microbatch import split_mini_batches

#: The sampling temperature the batch was drawn at (`EngineContext.temperature`).
TEMPERATURE = 0.7

#: The layer's train settings: float32 and padded (the reference's arithmetic), two
#: mini-batches, micro-batches of at most 40 tokens (two or more per mini-batch). Adam's
#: `eps` is 1e-3: with 1e-8 a 1e-9 gradient of a rarely used embedding row moves as far as
#: a large one, and float-summation noise would become the weights' difference.
OPTIM = OptimSettings(lr=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0,
                      micro_batch_tokens=40, mini_batches=2, bf16=False, padding_free=False)

#: `(prompt, answers)` in token ids of the suite's character tokenizer.
GROUPS = (
    ((2, 3, 4, 5, 6, 7), ((14, 15, 16), (20, 21, 22, 23, 24, 25), (30, 31), (40, 41, 42, 43))),
    ((10, 11, 12), ((7, 8, 9, 10, 11), (12,), (33, 34, 35, 36, 37, 38, 39), (5, 6, 7))),
)
#: One advantage per sample (GRPO: the answer's normalised reward, both signs per group).
ADVANTAGES = (1.3, -0.6, 0.8, -1.5, -0.9, 1.7, 0.2, -1.0)
#: Old log-probs are the reference's moved by this × sin(token index): stale samples.
STALENESS = 0.3


def rows() -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """`(prompt_ids, response_ids)` of every sample, prompt by prompt."""
    return [(prompt, answer) for prompt, answers in GROUPS for answer in answers]


def train_batch(config: Any, tensors: Mapping[str, torch.Tensor]) -> Batch:
    """The fixed batch, with `advantages` and stale `old_logprobs` (host tensors).

    Args:
        config: The model's `transformers` config.
        tensors: Its checkpoint's HF tensors (the old log-probs are scored with them).
    """
    samples = rows()
    n = len(samples)
    group_id = torch.tensor([g for g, (_, answers) in enumerate(GROUPS) for _ in answers])
    scored = reference_logprobs(config, tensors, samples, TEMPERATURE, dtype=torch.float64)
    old = [(row + STALENESS * torch.sin(torch.arange(len(row), dtype=torch.float64) * 1.7 + i))
           .float() for i, row in enumerate(scored)]
    return Batch(
        sample_id=torch.arange(n), group_id=group_id,
        weight_version=torch.zeros(n, dtype=torch.int64), fields={
            "prompt_ids": RaggedField.from_tensors([torch.tensor(p) for p, _ in samples]),
            "response_ids": RaggedField.from_tensors([torch.tensor(r) for _, r in samples]),
            "advantages": RaggedField.from_tensors(
                [torch.full((len(r),), a) for (_, r), a in zip(samples, ADVANTAGES)]),
            "old_logprobs": RaggedField.from_tensors(old)})


def train_loss() -> PPOClip:
    """The loss of the layer: PPO-clip (±0.2), token-mean, as GRPO and DAPO train."""
    return PPOClip()


@attrs.frozen(kw_only=True)
class StepOutcome:
    """What one `train_step` produced: its metrics and the weights after it."""

    loss: float
    """The step's `loss` metric (mean over mini-batches)."""
    grad_norm: float
    """The step's `grad_norm` metric (before clipping, mean over mini-batches)."""
    weights: dict[str, torch.Tensor] = attrs.field(repr=False)
    """Every HF tensor after the step (host, float64)."""


def reference_model(config: Any, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
                    attn_implementation: str) -> Any:
    """A plain `transformers` model of `config` holding `tensors`, in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation).to(dtype)
    model.load_state_dict(module_tensors(model, tensors), strict=False)
    return model


def tempered_logprobs(model: Any, batch: Batch) -> RaggedField:
    """Each sample's response-token `log_softmax(logits / T)`, with grad, one row each."""
    values = []
    for prompt, response in zip(batch["prompt_ids"].rows(), batch["response_ids"].rows()):
        ids = torch.cat([prompt, response])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        values.append(logp.gather(1, response[:, None])[:, 0])
    return RaggedField.from_tensors(values)


def reference_step(config: Any, tensors: Mapping[str, torch.Tensor], batch: Batch, *,
                   dtype: torch.dtype = torch.float64,
                   attn_implementation: str = "eager") -> StepOutcome:
    """One `train_step` on `batch` as the contract defines it, written plainly.

    Per mini-batch (contiguous, `OPTIM.mini_batches`): zero the gradients, score every
    sample, the loss with the mini-batch's token and sample counts, backward, clip the
    global norm (recorded before clipping), one AdamW step.
    """
    model = reference_model(config, tensors, dtype=dtype,
                            attn_implementation=attn_implementation).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                                  weight_decay=OPTIM.weight_decay)
    loss_fn = train_loss()
    losses, norms = [], []
    for indices in split_mini_batches(len(batch), OPTIM.mini_batches):
        mini = batch.select(indices)
        optimizer.zero_grad()
        value, _ = loss_fn(tempered_logprobs(model, mini), mini,
                           global_tokens=int(mini.trained_lengths().sum()),
                           global_samples=int((mini.trained_lengths() > 0).sum()))
        value.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, OPTIM.grad_clip)))
        optimizer.step()
        losses.append(value.item())
    state = model.state_dict()
    weights = {name: state[name].detach().double() for name in hf_parameters(config)}
    return StepOutcome(loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms),
                       weights=weights)


@attrs.frozen(kw_only=True)
class StepTolerance:
    """How close an engine's step must come to the float64 reference, and why."""

    loss: float
    grad_norm: float
    weights: float
    spread: dict[str, float]
    """The reference's own spread per quantity across its float32 paths."""

    def explain(self, what: str) -> str:
        """The tolerance of `what` (`loss`, `grad_norm`, `weights`) and where it comes from."""
        paths = ", ".join(f"{str(d).removeprefix('torch.')} {a}" for d, a in PATHS)
        return (f"tolerance {getattr(self, what):.2e} = max({FACTOR:g} x the reference's own "
                f"spread {self.spread[what]:.2e} across {paths}, floor)")


def weight_gap(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Largest absolute difference over every tensor both hold."""
    return max((float((a[n].double() - b[n].double()).abs().max()) for n in a.keys() & b.keys()),
               default=0.0)


def derive_step(config: Any, tensors: Mapping[str, torch.Tensor],
                batch: Batch) -> tuple[StepOutcome, StepTolerance]:
    """The float64 reference step and the tolerances its float32 paths imply."""
    (dtype, attn), *others = PATHS
    truth = reference_step(config, tensors, batch, dtype=dtype, attn_implementation=attn)
    spread = {"loss": 0.0, "grad_norm": 0.0, "weights": 0.0}
    for dtype, attn in others:
        path = reference_step(config, tensors, batch, dtype=dtype, attn_implementation=attn)
        spread["loss"] = max(spread["loss"], abs(path.loss - truth.loss))
        spread["grad_norm"] = max(spread["grad_norm"], abs(path.grad_norm - truth.grad_norm))
        spread["weights"] = max(spread["weights"], weight_gap(path.weights, truth.weights))
    scale = {"loss": abs(truth.loss), "grad_norm": truth.grad_norm, "weights": 1.0}
    tolerance = {k: max(FLOOR * max(1.0, scale[k]), FACTOR * spread[k]) for k in spread}
    return truth, StepTolerance(spread=spread, **tolerance)
