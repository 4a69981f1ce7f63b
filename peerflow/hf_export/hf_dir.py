"""The one writer of Hugging Face model directories (`peerflow export`, `peerflow sft`).

A directory holds the weights as safetensors (one file, or shards of at most
`max_shard_size` with `model.safetensors.index.json`, written by `huggingface_hub`'s
`save_torch_state_dict`), `config.json` (its `dtype` the weights'), `generation_config.json`
when the source model has one, and the tokenizer with its chat template — what
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load. Tied
tensors are written once, under the name `named_parameters()` gives them (the embedding);
MoE experts one by one, as `save_pretrained` writes them (`checkpoint_names`).

Before writing, the tensors are checked against the architecture of `config` (built on
the meta device, no memory): every parameter and persistent buffer present with its shape,
nothing else, so a directory that would not load is never written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from peerflow.errors import ShardError

#: Largest safetensors file before the weights are split (`save_pretrained`'s default).
DEFAULT_SHARD_SIZE = "5GB"


def expected_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor a checkpoint of `config`'s architecture holds.

    Tied parameters count once (the name `named_parameters()` keeps); non-persistent
    buffers (rotary frequencies) are not saved.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    kept = {name for name, _ in model.named_parameters()}
    return {name: tuple(t.shape) for name, t in state.items() if name not in every - kept}


def checkpoint_names(config: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` under the names `transformers`' own `save_pretrained` writes.

    A `transformers` ≥ 5 MoE module packs its experts (`mlp.experts.gate_up_proj`
    `[E, 2I, H]`, `down_proj` `[E, H, I]`); its checkpoints hold them one by one
    (`mlp.experts.{e}.gate_proj.weight`, … ; Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`
    and `block_sparse_moe.gate`), which `from_pretrained` packs on load and other engines
    (vLLM) read. The split follows the layout `peerflow.models.packed_experts` declares for
    the weight sync; tensors already under checkpoint names (a Megatron or DeepSpeed
    export) and dense models pass unchanged. The pieces are views (saving copies them).
    """
    from peerflow.models.packed_experts import canonical_expert_spec
    from peerflow.shard import ShardSpec

    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        spec = canonical_expert_spec(config, ShardSpec.of_slice(name, tuple(tensor.shape)))
        if spec is None:
            out[name] = tensor
            continue
        local = tensor.reshape(spec.local_shape)
        for piece in spec.pieces:
            out[piece.name] = local[piece.local_box.slices()]
    return out


def _check(tensors: Mapping[str, torch.Tensor], config: Any) -> None:
    from peerflow.checkpoint.strict import shape_differences

    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    want = checkpoint_names(config, {n: torch.empty(s, device="meta")
                                     for n, s in expected_tensors(config).items()})
    problems = shape_differences(shapes, {n: tuple(t.shape) for n, t in want.items()},
                                 have_name="weights", want_name="architecture")
    if problems:
        raise ShardError(
            f"the weights do not fit {type(config).__name__} ({'; '.join(problems)}): the "
            "checkpoint was written from another model than the config's model directory. "
            "Export with the model the run was trained from (its config.yaml's model section)."
        )


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A live model's parameters (tied ones once) and persistent buffers, detached."""
    names = set(expected_tensors(model.config))
    return {n: t.detach() for n, t in model.state_dict().items() if n in names}


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as safetensors saves it: a copy where it views a larger buffer.

    safetensors refuses such views; DeepSpeed's `zero_to_fp32` returns them (one flat
    buffer per parameter group).
    """
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor.contiguous()
    return tensor.clone(memory_format=torch.contiguous_format)


def _readable(paths: Any) -> None:
    """Gives files the permissions the umask allows (safetensors writes owner-only ones)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in paths:
        path.chmod(0o666 & ~mask)


def write_model_dir(out_dir: str | Path, tensors: Mapping[str, torch.Tensor], *, config: Any,
                    tokenizer: Any = None, generation_config: Any = None,
                    max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Writes a Hugging Face model directory.

    Args:
        out_dir: Directory to write into (created; existing files of the same names are
            replaced, so give a new or empty one).
        tensors: HF name → tensor, every parameter once (`unique_tensors` for a live model);
            module names (packed experts) or checkpoint names.
        config: The model's `transformers` config; its `dtype` is set to the tensors'.
        tokenizer: A `transformers` tokenizer to save beside (its chat template included).
        generation_config: A `GenerationConfig` to save, or `None`.
        max_shard_size: Largest safetensors file (e.g. `"5GB"`, bytes as an int).

    Returns:
        `out_dir`.

    Raises:
        ShardError: the tensors do not fit `config`'s architecture (names the tensors).
    """
    from huggingface_hub import save_torch_state_dict

    tensors = checkpoint_names(config, tensors)
    _check(tensors, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    save_torch_state_dict({n: _own_storage(t) for n, t in tensors.items()}, out,
                          max_shard_size=max_shard_size, metadata={"format": "pt"})
    _readable(out.glob("*.safetensors"))
    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
