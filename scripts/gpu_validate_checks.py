"""GPU check programs that `scripts/gpu_validate.py` runs (one subcommand per check).

Each prints one line `GPU_VALIDATE_FIGURES {json}` and exits 0 (passed), 3 (the machine
cannot run it; the reason is in the figures) or anything else (failed).

* `env` — the device, memory, torch/CUDA/NCCL versions and the engines importable;
* `nccl-pair` — two processes on GPU 0 run the collectives the runtime uses over NCCL;
  NCCL refuses two ranks on one device ("Duplicate GPU detected"), which is then
  reported as unsupported with NCCL's message;
* `ipc-pair` — two processes on GPU 0 sync a Qwen2.5-1.5B-sized bf16 parameter set
  through the run's weight-sync path over the `cuda_ipc` transport, cold and warm, in
  GB/s against a goal of 500 (`gpu_validate_ipc`), checked bit for bit;
* `realsize` — `peerflow train` on a random Llama with the Qwen2.5-1.5B shape
  (28 layers, hidden 1536, MLP 8960, 12 query / 2 key-value heads, vocabulary 151936),
  ~500-token prompts and 1024-token answers, bf16, one GPU: per step the generate /
  train / weight-sync seconds and tokens (from the run's `metrics.jsonl`), the train MFU
  (6 x parameters x tokens / train seconds / the device's dense bf16 peak,
  `PEAK_BF16_TFLOPS`; null with the reason for a device not in the table) and the peak
  GPU memory (`torch.cuda.max_memory_allocated`);
* `bench-train` — `peerflow bench train` on realsize's model (built by realsize, found by
  key): one fsdp bf16 step padded vs padding-free, tokens/s, padding fraction, peak
  memory and MFU;
* `moe-r3` — routing replay on the GPU (`peerflow bench moe --device cuda`): a tiny
  Qwen3-MoE sampled by the hf engine in bf16 with its routes, scored by the fsdp trainer
  with native routing and with r3; passes with agreement 1.0 under r3 and a smaller
  rollout-vs-trainer log-prob difference than native routing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _bench_mfu() -> Any:
    """`peerflow/bench/mfu.py` (no dependencies), loaded by path.

    The kit's dry run and its first checks run before PeerFlow is installed.
    """
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "peerflow" / "bench" / "mfu.py"
    spec = importlib.util.spec_from_file_location("peerflow_bench_mfu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The MFU figures are `peerflow bench train`'s (one table of device peaks).
_MFU = _bench_mfu()
PEAK_BF16_TFLOPS, peak_bf16_tflops, train_mfu = (
    _MFU.PEAK_BF16_TFLOPS, _MFU.peak_bf16_tflops, _MFU.train_mfu)

#: Where check programs print their figures: one line `GPU_VALIDATE_FIGURES {json}`.
FIGURES_PREFIX = "GPU_VALIDATE_FIGURES "
#: Exit status of a check program when the machine cannot run the check (reason in figures).
UNSUPPORTED_EXIT = 3
#: Seconds `nccl-pair` waits for its two ranks (its budget in the kit is 20 s).
PAIR_WAIT_S = 14
#: Qwen2.5-1.5B: hidden, intermediate, layers, heads, kv heads, vocabulary.
QWEN25_15B = (1536, 8960, 28, 12, 2, 151936)


def emit(figures: dict[str, Any], status: int = 0) -> None:
    """Prints the figures line and exits with `status`."""
    print(FIGURES_PREFIX + json.dumps(figures), flush=True)
    sys.exit(status)


def check_env() -> None:
    """Device, memory and versions; fails when CUDA is not available."""
    import importlib

    import torch

    figures: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                               "cuda": torch.version.cuda, "cuda_available":
                               torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(device=props.name, devices=torch.cuda.device_count(),
                       memory_gib=round(props.total_memory / 2**30, 1),
                       nccl=".".join(map(str, torch.cuda.nccl.version())),
                       bf16=torch.cuda.is_bf16_supported())
    for module in ("peerflow", "transformers", "deepspeed", "megatron.core", "vllm", "sglang"):
        try:
            figures[module] = getattr(importlib.import_module(module), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            figures[module] = f"not importable ({type(exc).__name__})"
    emit(figures, 0 if torch.cuda.is_available() else 1)


def _nccl_rank(rank: int, port: int, queue: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    times: dict[str, float] = {}
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=PAIR_WAIT_S))
        x = torch.full((1 << 20,), float(rank + 1), device="cuda")
        ops = {
            "all_reduce": lambda: dist.all_reduce(x.clone()),
            "all_gather": lambda: dist.all_gather_into_tensor(
                torch.empty(2 * x.numel(), device="cuda"), x),
            "broadcast": lambda: dist.broadcast(x.clone(), src=0),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(x), x),
            "send_recv": lambda: (dist.send(x, 1) if rank == 0
                                  else dist.recv(torch.empty_like(x), 0)),
        }
        for name, op in ops.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            op()
            torch.cuda.synchronize()
            times[name + "_s"] = round(time.perf_counter() - start, 5)
        dist.destroy_process_group()
        queue.put((rank, "ok", times))
    except Exception as exc:  # noqa: BLE001 - the parent reports NCCL's own message
        queue.put((rank, "error", f"{type(exc).__name__}: {str(exc)[:600]}"))


def check_nccl_pair() -> None:
    """Two ranks on one GPU over NCCL (NCCL normally refuses: reported as unsupported)."""
    import torch.multiprocessing as mp

    from peerflow.distributed.init import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + PAIR_WAIT_S
    try:
        for _ in range(2):
            rank, status, value = queue.get(timeout=max(deadline - time.monotonic(), 0.1))
            results[rank] = (status, value)
    except Exception:  # noqa: BLE001 - a rank hung: NCCL waited for a peer that failed
        pass
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            p.kill()
    if len(results) == 2 and all(s == "ok" for s, _ in results.values()):
        emit({"ranks": 2, "device": "cuda:0", **results[0][1]})
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    reason = next(iter(errors.values()), f"a rank did not report within {PAIR_WAIT_S} s")
    duplicate = "duplicate gpu" in reason.lower()
    emit({"reason": reason, "nccl_refuses_shared_gpu": duplicate},
         UNSUPPORTED_EXIT if duplicate else 1)


def check_ipc_pair() -> None:
    """Colocated weight sync over `cuda_ipc`, two processes on one GPU (`gpu_validate_ipc`)."""
    from gpu_validate_ipc import check_ipc_pair as run

    run(emit, UNSUPPORTED_EXIT, QWEN25_15B)


def count_parameters(model_dir: Path) -> int:
    """Parameters in a model directory's `*.safetensors` headers (tied weights once)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= int(d)
                total += n
    return total


#: Per-step figures realsize reads from `metrics.jsonl` (`peerflow.outputs.metrics`):
#: the phase times are `time/<node>` (max over ranks, `peerflow.worker.loop.timed`).
REALSIZE_KEYS = {"generate_s": "time/generate", "train_s": "time/train_actor",
                 "sync_s": "time/sync_weights", "checkpoint_s": "time/checkpoint",
                 "step_s": "time/step", "tokens": "tokens/total",
                 "prompt_tokens": "tokens/prompt", "response_tokens": "tokens/response",
                 "tokens_per_s": "throughput/tokens_per_s",
                 "sync_wire_s": "weight_sync/wire_s", "sync_bytes": "weight_sync/bytes"}


def realsize_figures(rows: list[dict[str, Any]], params: int, device: str,
                     peak_bytes: int) -> dict[str, Any]:
    """The realsize figures from a run's metrics rows.

    Per step: generate / train / weight-sync seconds and tokens; the last step's train
    MFU; the peak GPU memory.
    """
    steps = []
    for row in rows:
        step = {"step": row.get("step")}
        for name, key in REALSIZE_KEYS.items():
            if isinstance(row.get(key), (int, float)):
                step[name] = round(float(row[key]), 4)
        steps.append(step)
    last = steps[-1] if steps else {}
    mfu, why = train_mfu(params, last.get("tokens", 0.0), last.get("train_s", 0.0), device)
    figures: dict[str, Any] = {
        "device": device, "parameters": params,
        "generate_s": last.get("generate_s"), "train_s": last.get("train_s"),
        "weight_sync_s": last.get("sync_s"), "tokens": last.get("tokens"),
        "train_mfu": None if mfu is None else round(mfu, 4),
        "peak_gpu_gib": round(peak_bytes / 2**30, 2), "steps": steps}
    if mfu is None:
        figures["train_mfu_reason"] = why
    else:
        figures["peak_bf16_tflops"] = peak_bf16_tflops(device)[0]
    return figures


def realsize_model(out: Path) -> str:
    """The random Qwen2.5-1.5B-shaped model under `out` (built once, then found by key)."""
    from peerflow.bench.shapes import build_model

    hidden, inter, layers, heads, kv, vocab = QWEN25_15B
    return build_model(out / "model", {
        "hidden_size": hidden, "intermediate_size": inter, "num_layers": layers,
        "num_heads": heads, "num_kv_heads": kv, "vocab_size": vocab, "reserved_tokens": 0,
        "initializer_range": 0.02, "max_position_embeddings": 2048})


def check_bench_train() -> None:
    """`peerflow bench train` (fsdp, bf16) on realsize's model: padded vs padding-free.

    16 samples (2 prompts of 512 tokens, 8 long-tailed answers each up to 1024 tokens),
    median of 3 steps per layout: tokens/s, padding fraction, peak memory, MFU.
    """
    import argparse

    import torch

    from peerflow.bench import train as bench

    if not torch.cuda.is_available():
        emit({"reason": "no CUDA device"}, UNSUPPORTED_EXIT)
    out = Path(os.environ.get("OUT") or "runs/gpu-validate") / "realsize"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args([
        "--shape", "realistic", "--model", realsize_model(out), "--dtype", "bfloat16",
        "--bf16", "--prompts", "2", "--group-size", "8", "--prompt-tokens", "512",
        "--max-tokens", "1024", "--repeats", "3"]))
    figures = {key: result[key] for key in ("device", "parameters", "real_tokens", "speedup")}
    for name, layout in result["layouts"].items():
        figures[name] = {key: layout.get(key) for key in (
            "step_s", "tokens_per_s", "padding_fraction", "peak_memory_gib", "mfu")}
    emit(figures)


def check_realsize() -> None:
    """`peerflow train` on the Qwen2.5-1.5B shape; figures from its metrics.jsonl.

    Generate / train / weight-sync seconds, train MFU and peak GPU memory.
    """
    import torch

    from peerflow.worker.main import run_worker

    if not torch.cuda.is_available():
        emit({"reason": "no CUDA device"}, UNSUPPORTED_EXIT)
    out = Path(os.environ.get("OUT") or "runs/gpu-validate") / "realsize"
    model = realsize_model(out)
    overrides = [f"model.path={model}", "model.builder=null", "model.dtype=bfloat16",
                 "task.options={digits: 500}", "rollout.sampling.max_tokens=1024",
                 "rollout.sampling.n=4", "run.prompts_per_step=2", "run.steps=2",
                 "runtime.nprocs=1", "run.tensorboard=false", "run.trace=false",
                 "run.checkpoint_every=0"]
    run_dir = out / "run"
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run_worker("examples/quickstart.yaml", overrides, str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    figures = realsize_figures(rows, count_parameters(Path(model)),
                               torch.cuda.get_device_name(0), torch.cuda.max_memory_allocated())
    figures.update(model="Qwen2.5-1.5B shape (Llama blocks), random bf16 weights",
                   wall_s=round(time.perf_counter() - start, 1),
                   sleep_wake="not measured: the hf rollout engine declares no sleep(); "
                              "vLLM and SGLang, which do, are too large for the wheel folder")
    emit(figures)


def moe_r3_figures(result: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The `moe-r3` figures from a `peerflow bench moe` result, and whether they pass.

    Passing: agreement 1.0 under r3 (no replayed route without an expert in common with
    the trainer's own top-k) and a smaller mean |log-prob difference| than native routing.
    """
    off, r3 = result["off"], result["r3"]
    agreement = 1.0 - float(r3["moe/replay_no_overlap"])
    figures = {"device": result.get("device"), "model": result["model"],
               "rollout_dtype": result["rollout"]["dtype"],
               "sampled_tokens": result["sampled_tokens"], "agreement": agreement,
               "replay_changed": r3["moe/replay_changed"],
               "mean_abs_logprob_diff_off": off["mean_abs_logprob_diff"],
               "mean_abs_logprob_diff_r3": r3["mean_abs_logprob_diff"],
               "ratio_off_over_r3": result["abs_diff_ratio_off_over_r3"]}
    passed = agreement == 1.0 and r3["mean_abs_logprob_diff"] < off["mean_abs_logprob_diff"]
    return figures, passed


def check_moe_r3() -> None:
    """Routing replay on the GPU: `peerflow bench moe --device cuda`, agreement 1.0 under r3.

    A tiny Qwen3-MoE: the hf engine samples in bf16 on the GPU recording routes; the fsdp
    trainer (fp32, same GPU) scores the tokens with native routing and with r3.
    """
    import argparse

    import torch

    from peerflow.bench import moe as bench

    if not torch.cuda.is_available():
        emit({"reason": "no CUDA device"}, UNSUPPORTED_EXIT)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--device", "cuda", "--rollout-dtype", "bfloat16"]))
    figures, passed = moe_r3_figures(result)
    emit(figures, 0 if passed else 1)


def vllm_moe_r3_figures(result: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The `vllm-moe-r3` figures from a `peerflow bench moe --rollout vllm` result.

    Passing: every sample carries vLLM's routes, every token fed to the model has one on
    every routed layer (shape and count are checked by `routes_column` on the way), and
    replaying them on the trainer agrees fully (`moe/replay_no_overlap` 0).
    """
    figures, _ = moe_r3_figures(result)
    routes = result["routes"]
    figures.update(rollout_engine=result["rollout"]["engine"], **routes)
    passed = (figures["agreement"] == 1.0 and routes["samples"] > 0
              and routes["samples_with_routes"] == routes["samples"]
              and routes["fed_tokens_without_route"] == 0)
    return figures, passed


def check_vllm_moe_r3() -> None:
    """R3 from vLLM: `peerflow bench moe --rollout vllm --device cuda`, agreement 1.0.

    vLLM (bf16, Model Runner V2, `enable_return_routed_experts`) samples a tiny Qwen3-MoE
    returning every token's experts; the fsdp trainer (fp32) replays them. Unsupported
    (exit 3, with the reason) where vLLM is not installed or cannot return routes.
    """
    import argparse
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        emit({"reason": "no CUDA device"}, UNSUPPORTED_EXIT)
    if importlib.util.find_spec("vllm") is None:
        emit({"reason": "vLLM is not installed (not in the wheel folder: too large); "
                        "pip install 'peerflow[vllm]' on the GPU image to run this check"},
             UNSUPPORTED_EXIT)
    from peerflow.adapters.vllm.routes import routes_unsupported_reason
    from peerflow.bench import moe as bench

    reason = routes_unsupported_reason()
    if reason is not None:
        emit({"reason": reason}, UNSUPPORTED_EXIT)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--rollout", "vllm", "--device", "cuda",
                                          "--rollout-dtype", "bfloat16"]))
    figures, passed = vllm_moe_r3_figures(result)
    emit(figures, 0 if passed else 1)


CHECKS = {"env": check_env, "nccl-pair": check_nccl_pair, "ipc-pair": check_ipc_pair,
          "realsize": check_realsize, "bench-train": check_bench_train,
          "moe-r3": check_moe_r3, "vllm-moe-r3": check_vllm_moe_r3}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(CHECKS)}}}")
    CHECKS[sys.argv[1]]()
