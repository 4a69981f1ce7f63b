"""GPU check programs that `scripts/gpu_validate.py` runs (one subcommand per check).

Each prints one line `GPU_VALIDATE_FIGURES {json}` and exits 0 (passed), 3 (the machine
cannot run it; the reason is in the figures) or anything else (failed).

* `env` — the device, memory, torch/CUDA/NCCL versions and the engines importable;
* `nccl-pair` — two processes on GPU 0 run the collectives the runtime uses over NCCL;
  NCCL refuses two ranks on one device ("Duplicate GPU detected"), which is then
  reported as unsupported with NCCL's message;
* `ipc-pair` — two processes on GPU 0 move a Qwen2.5-1.5B-sized bf16 parameter set
  through PeerFlow's `cuda_ipc` weight transport (handles exchanged over gloo), timed
  plan / pack / wire / load and checked element for element;
* `realsize` — `peerflow train` on a random Llama with the Qwen2.5-1.5B shape
  (28 layers, hidden 1536, MLP 8960, 12 query / 2 key-value heads, vocabulary 151936),
  ~500-token prompts and 1024-token answers, bf16, one GPU: tokens/s of a GRPO step,
  per-node times including the weight sync, and peak GPU memory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: Where check programs print their figures: one line `GPU_VALIDATE_FIGURES {json}`.
FIGURES_PREFIX = "GPU_VALIDATE_FIGURES "
#: Exit status of a check program when the machine cannot run the check (reason in figures).
UNSUPPORTED_EXIT = 3
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
                                world_size=2, timeout=datetime.timedelta(seconds=15))
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
    try:
        for _ in range(2):
            rank, status, value = queue.get(timeout=60)
            results[rank] = (status, value)
    except Exception:  # noqa: BLE001 - a rank hung: NCCL waited for a peer that failed
        pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if len(results) == 2 and all(s == "ok" for s, _ in results.values()):
        emit({"ranks": 2, "device": "cuda:0", **results[0][1]})
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    reason = next(iter(errors.values()), "a rank did not report within 60 s")
    duplicate = "duplicate gpu" in reason.lower()
    emit({"reason": reason, "nccl_refuses_shared_gpu": duplicate},
         UNSUPPORTED_EXIT if duplicate else 1)


def _param_shapes() -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, layers, heads, kv, vocab = QWEN25_15B
    head = hidden // heads
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)),
                   (p + "self_attn.k_proj.weight", (kv * head, hidden)),
                   (p + "self_attn.v_proj.weight", (kv * head, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)),
                   (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter))]
    return shapes


def _ipc_rank(rank: int, port: int, queue: Any, bucket_bytes: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from peerflow.reshard.transports import CudaIpcTransport

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    start = time.perf_counter()
    shapes = _param_shapes()
    buckets: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:  # plan: consecutive parameters up to bucket_bytes
        nbytes = 2 * int(torch.Size(shape).numel())
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, shape))
        size += nbytes
    plan_s = time.perf_counter() - start
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen)
              if rank == 0 else torch.empty(s, device="cuda", dtype=torch.bfloat16)
              for n, s in shapes}
    transport = CudaIpcTransport(rank=rank, group=None, device="cuda")
    pack = wire = load = 0.0
    for bucket in buckets:
        numel = sum(int(torch.Size(s).numel()) for _, s in bucket)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flat = (torch.cat([params[n].reshape(-1) for n, _ in bucket]) if rank == 0 else None)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        got = transport.exchange({1: flat} if rank == 0 else {},
                                 {0: numel} if rank == 1 else {}, [])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if rank == 1:
            offset = 0
            for name, shape in bucket:
                n = int(torch.Size(shape).numel())
                params[name].copy_(got[0][offset:offset + n].view(shape))
                offset += n
        torch.cuda.synchronize()
        pack, wire, load = pack + t1 - t0, wire + t2 - t1, load + time.perf_counter() - t2
    checksum = torch.stack([p.float().sum() for p in params.values()]).sum().item()
    total = sum(2 * int(torch.Size(s).numel()) for _, s in shapes)
    queue.put((rank, {"plan_s": plan_s, "pack_s": pack, "wire_s": wire, "load_s": load,
                      "bytes": total, "buckets": len(buckets), "checksum": checksum}))
    dist.barrier()
    dist.destroy_process_group()


def check_ipc_pair() -> None:
    """CUDA-IPC weight transfer between two processes on one GPU, verified."""
    import torch
    import torch.multiprocessing as mp

    from peerflow.distributed.init import free_port

    if not torch.cuda.is_available():
        emit({"reason": "no CUDA device"}, UNSUPPORTED_EXIT)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ipc_rank, args=(r, port, queue, 256 * 2**20))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=30)
    sender, receiver = results[0], results[1]
    same = abs(sender["checksum"] - receiver["checksum"]) <= 1e-3 * abs(sender["checksum"])
    figures = {"bytes": sender["bytes"], "buckets": sender["buckets"],
               "plan_s": round(sender["plan_s"], 4), "pack_s": round(sender["pack_s"], 4),
               "wire_s": round(max(sender["wire_s"], receiver["wire_s"]), 4),
               "load_s": round(receiver["load_s"], 4), "identical": same}
    figures["gb_per_s"] = round(sender["bytes"] / 1e9 / max(
        figures["pack_s"] + figures["wire_s"] + figures["load_s"], 1e-9), 2)
    emit(figures, 0 if same else 1)


def check_realsize() -> None:
    """`peerflow train` on the Qwen2.5-1.5B shape; throughput, times and peak memory."""
    import torch

    from peerflow.bench.shapes import build_model
    from peerflow.worker.main import run_worker

    out = Path(os.environ.get("OUT") or "runs/gpu-validate") / "realsize"
    hidden, inter, layers, heads, kv, vocab = QWEN25_15B
    model = build_model(out / "model", {
        "hidden_size": hidden, "intermediate_size": inter, "num_layers": layers,
        "num_heads": heads, "num_kv_heads": kv, "vocab_size": vocab, "reserved_tokens": 0,
        "initializer_range": 0.02, "max_position_embeddings": 2048})
    overrides = [f"model.path={model}", "model.builder=null", "model.dtype=bfloat16",
                 "task.options={digits: 500}", "rollout.sampling.max_tokens=1024",
                 "rollout.sampling.n=4", "run.prompts_per_step=2", "run.steps=2",
                 "runtime.nprocs=1", "run.tensorboard=false", "run.trace=false",
                 "run.checkpoint_every=0"]
    run_dir = out / "run"
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run_worker("examples/quickstart.yaml", overrides, str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    figures = {"model": "Qwen2.5-1.5B shape (Llama blocks), random bf16 weights",
               "wall_s": round(time.perf_counter() - start, 1),
               "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
               "sleep_wake": "not measured: the hf rollout engine declares no sleep(); "
                             "vLLM and SGLang, which do, are too large for the wheel folder"}
    for key in ("throughput/tokens_per_s", "tokens/prompt", "tokens/response", "time/step",
                "time/generate", "time/train_actor", "time/sync_weights"):
        if key in last:
            figures[key] = round(float(last[key]), 3)
    emit(figures)


CHECKS = {"env": check_env, "nccl-pair": check_nccl_pair, "ipc-pair": check_ipc_pair,
          "realsize": check_realsize}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(CHECKS)}}}")
    CHECKS[sys.argv[1]]()
