"""The emulated accelerator (`peerflow.testing.emulated_device`).

The emulation is process-wide and cannot be undone (it makes `torch.accelerator` report a
device), so every check runs in a fresh Python process; each child prints one JSON line
of what it saw, and the assertions live here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerflow.testing.emulated_device import unsupported_reason

ROOT = Path(__file__).resolve().parents[2]
REASON = unsupported_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PRELUDE = """
import json, os, sys, tempfile
import torch
from peerflow.testing import emulated_device as emulation
def report(**values):
    print("RESULT:" + json.dumps(values), flush=True)
def error(action):
    try:
        action()
    except RuntimeError as raised:
        return str(raised)
    return None
"""

MIXES = PRELUDE + """
dev = emulation.install()
again = emulation.install()
cpu, on_dev = torch.ones(3), torch.ones(3, device="emu")
idx_cpu = torch.tensor([0, 2])
idx_dev = idx_cpu.to("emu")
square = torch.ones(2, 2, device="emu")
refused = {
    "cpu.mul_(dev)": lambda: cpu.clone().mul_(on_dev),
    "dev @ cpu": lambda: square @ torch.ones(2, 2),
    "cpu[dev_idx]": lambda: cpu[idx_dev],
    "dev.index_put_(cpu_values)": lambda: on_dev.clone().index_put_((idx_cpu,), torch.ones(2)),
    "embedding(cpu_ids)": lambda: torch.nn.functional.embedding(idx_cpu, square),
    "repeat_interleave(dev, cpu_repeats)":
        lambda: torch.repeat_interleave(on_dev, torch.tensor([1, 2, 1])),
    "cumsum(dev, out=cpu)": lambda: torch.cumsum(on_dev, 0, out=torch.empty(3)),
    "equal(cpu, dev)": lambda: torch.equal(cpu, on_dev),
    "dev + cpu": lambda: on_dev + cpu,
    "cat([dev, cpu])": lambda: torch.cat([on_dev, cpu]),
    "where(mask, dev, cpu)": lambda: torch.where(on_dev > 0, on_dev, cpu),
    "index_select(dev, cpu_idx)": lambda: on_dev.index_select(0, idx_cpu),
    "cross_entropy(dev, cpu_targets)":
        lambda: torch.nn.functional.cross_entropy(square, torch.tensor([0, 1])),
}
offsets = torch.zeros(4, device="emu")
torch.cumsum(on_dev, 0, out=offsets[1:])
mask = torch.tensor([True, False, True])
grown = torch.empty(0, device="emu")
torch.cumsum(on_dev, 0, out=grown)
x = torch.zeros(5, device="emu")
x[torch.tensor([1, 3])] = 2.0
x[x > 0] += 1.0
legal = {
    "dev * cpu_scalar": (on_dev * torch.tensor(2.0)).tolist(),
    "dev[cpu_idx]": on_dev[idx_cpu].tolist(),
    "dev[cpu_mask]": torch.arange(3.0, device="emu")[mask].tolist(),
    "cumsum(out=dev)": offsets.tolist(),
    "cumsum(out=empty dev)": [list(grown.shape), grown.tolist()],
    "index assignment": x.tolist(),
    "nonzero": (x > 0).nonzero().flatten().tolist(),
    "repeat_interleave(dev, dev)":
        torch.repeat_interleave(on_dev, torch.tensor([1, 2, 1], device="emu")).tolist(),
    "index_add": torch.zeros(3, device="emu").index_add(0, idx_dev, on_dev[:2]).tolist(),
    "equal(dev, dev)": torch.equal(on_dev, torch.ones(3, device="emu")),
    "cpu.copy_(dev)": torch.zeros(3).copy_(on_dev * 3).tolist(),
    "item": torch.arange(5, device="emu").sum().item(),
}
gen = torch.Generator("emu").manual_seed(7)
weight = torch.nn.Parameter(torch.ones(2, 3, device="emu"))
with torch.inference_mode():  # as on the CPU: a view of a normal tensor is a normal tensor
    inference = [error(lambda: weight.t()), weight.t().is_inference(), (weight * 2).is_inference()]
report(
    inference=inference,
    refused={name: error(action) for name, action in refused.items()},
    legal=legal,
    device=str(dev), same=again == dev, installed=emulation.is_installed(),
    available=torch.accelerator.is_available(),
    accelerator=str(torch.accelerator.current_accelerator()),
    is_emu=torch.accelerator.current_accelerator() == torch.device("emu"),
    count=torch.accelerator.device_count(), index=torch.accelerator.current_device_index(),
    set_index=error(lambda: torch.accelerator.set_device_index(0)),
    bad_index=error(lambda: torch.accelerator.set_device_index(1)),
    cuda=torch.cuda.is_available(),
    types=[type(t).__name__ for t in (on_dev, on_dev.cpu(), torch.arange(3, device="emu"))],
    devices=[str(t.device) for t in (torch.tensor([1], device="emu"), on_dev.to("cpu"),
                                     torch.ones(2).to("emu"), torch.empty(1, device="emu"))],
    generated=torch.equal(torch.randn(4, device="emu", generator=gen).cpu(),
                          torch.randn(4, generator=torch.Generator().manual_seed(7))),
    cpu_generator=error(lambda: torch.randn(2, device="emu", generator=torch.Generator())),
    backend=torch.distributed.get_default_backend_for_device("emu"),
)
"""

#: A tiny Llama and its training loop, shared by the scripts that train one.
LLAMA = """
from transformers import LlamaConfig, LlamaForCausalLM

def tiny(attention="eager", tied=False):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=64, tie_word_embeddings=tied,
                         attn_implementation=attention)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)

def train(model, ids, foreach=True, steps=2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
"""

TRAINING = PRELUDE + LLAMA + """
import copy, time
import torch.distributed as dist
dev = emulation.install()


def gap(reference, model):
    return max((p.detach() - q.detach().cpu()).abs().max().item()
               for p, q in zip(reference.parameters(), model.parameters()))

ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
runs, timing = {}, {}
for attention, foreach in (("eager", False), ("eager", True), ("sdpa", None)):
    reference, model = tiny(attention, tied=True), tiny(attention, tied=True).to(dev)
    start = time.perf_counter()
    cpu_losses = train(reference, ids, foreach)
    middle = time.perf_counter()
    emu_losses = train(model, ids.to(dev), foreach)
    timing[attention] = [middle - start, time.perf_counter() - middle]
    runs[f"{attention}/{foreach}"] = dict(
        cpu=cpu_losses, emu=emu_losses, gap=gap(reference, model),
        tied=model.lm_head.weight is model.model.embed_tokens.weight,
        param=[type(model.lm_head.weight).__name__, str(model.lm_head.weight.device)])

from safetensors.torch import load_file, save_file
path = tempfile.mktemp(suffix=".safetensors")
state = {name: value.cpu() for name, value in model.state_dict().items()
         if name != "lm_head.weight"}
save_file(state, path)
saved = all(torch.equal(value, state[name]) for name, value in load_file(path).items())

dist.init_process_group(emulation.GROUP_BACKEND, init_method="file://" + tempfile.mktemp(),
                        rank=0, world_size=1)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh
reference, model = tiny(tied=True), tiny(tied=True).to(dev)
mesh = init_device_mesh("emu", (1,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
fsdp = dict(cpu=train(reference, ids, None, steps=3), emu=train(model, ids.to(dev), None, 3),
            param=[type(model.lm_head.weight).__name__, str(model.lm_head.weight.device)],
            gap=max((p.detach() - q.full_tensor().cpu()).abs().max().item()
                    for p, q in zip(reference.parameters(), model.parameters())))
dist.destroy_process_group()
report(runs=runs, timing=timing, saved=saved, fsdp=fsdp)
"""

COLLECTIVES = PRELUDE + """
import torch.distributed as dist
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from peerflow.distributed import devices
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
device = devices.rank_device()  # installs the emulation ($PEERFLOW_EMULATE_ACCELERATOR=1)
devices.use_device(device)
backend = devices.group_backend()
dist.init_process_group(backend, init_method="file://" + store, rank=rank, world_size=world)
seen = dict(device=str(device), backend=backend, share=devices.ranks_share_devices())
value = torch.full((3,), float(rank + 1), device="emu")
dist.all_reduce(value)
seen["all_reduce"] = value.tolist()
peak = torch.tensor([float(rank), 10.0 * rank], device="emu")
dist.all_reduce(peak, op=dist.ReduceOp.MAX)
seen["max"] = peak.tolist()
host = torch.full((2,), float(rank + 1))
dist.all_reduce(host)
seen["host"] = [host.tolist(), str(host.device)]
sent = torch.arange(3.0, device="emu") + rank
dist.broadcast(sent, 0)
seen["broadcast"] = sent.tolist()
parts = [torch.empty(1, device="emu") for _ in range(world)]
dist.all_gather(parts, torch.full((1,), float(rank), device="emu"))
seen["all_gather"] = [part.item() for part in parts]
joined = torch.empty(2 * world, device="emu")
dist.all_gather_into_tensor(joined, torch.full((2,), float(rank), device="emu"))
seen["all_gather_into_tensor"] = joined.tolist()
shard = torch.empty(1, device="emu")
dist.reduce_scatter_tensor(shard, torch.arange(float(world), device="emu"))
seen["reduce_scatter_tensor"] = shard.tolist()
swapped = torch.empty(world, device="emu")
dist.all_to_all_single(swapped, torch.arange(float(world), device="emu") + 10 * rank)
seen["all_to_all_single"] = swapped.tolist()
if rank == 0:
    dist.send(torch.tensor([42.0], device="emu"), 1)
    dist.isend(torch.tensor([43.0], device="emu"), 1).wait()
else:
    first, second = torch.empty(1, device="emu"), torch.empty(1, device="emu")
    dist.recv(first, 0)
    dist.irecv(second, 0).wait()
    seen["recv"] = [first.item(), second.item()]
dist.barrier()
summed = functional_all_reduce(torch.ones(2, device="emu"), "sum", dist.group.WORLD).wait()
seen["functional"] = [summed.tolist(), str(summed.device)]
inherited = dist.new_group(list(range(world)))
both = [torch.ones(1, device="emu"), torch.ones(1)]
for tensor in both:
    dist.all_reduce(tensor, group=inherited)
seen["new_group"] = [tensor.item() for tensor in both]
device_only = dist.new_group(list(range(world)), backend="emunccl")
on_device = torch.ones(1, device="emu")
dist.all_reduce(on_device, group=device_only)
seen["device_only"] = on_device.item()
seen["host_on_device_only"] = error(lambda: dist.all_reduce(torch.ones(1), group=device_only))
objects = [{"from": rank}]
dist.broadcast_object_list(objects, 0)
seen["objects"] = objects
seen["placed"] = sorted({str(t.device) for t in (value, peak, sent, *parts, joined, shard, swapped,
                                                 summed, both[0], on_device)})
dist.destroy_process_group()
report(rank=rank, **seen)
"""

COUNTS = PRELUDE + """
from peerflow.distributed import devices
failed = error(devices.accelerator_type)  # installs the emulation ($PEERFLOW_EMULATE_ACCELERATOR=1)
if failed:
    report(failed=failed)
else:
    report(count=torch.accelerator.device_count(), share=devices.ranks_share_devices(),
           device=str(devices.rank_device()), backend=devices.group_backend())
"""

INDICES = PRELUDE + LLAMA + """
import importlib.util
import torch.distributed as dist
from peerflow.distributed import devices
installed_on = str(emulation.install())
torch.accelerator.set_device_index(1)
on1, on0 = torch.ones(2, device="emu"), torch.ones(2, device="emu:0")
moved = on0.to("emu:1")
linear = torch.nn.Linear(2, 2).to("emu:0").to(torch.device("emu", 1))
placed = {
    "ones": on1, "tensor": torch.tensor([1.0], device="emu"), "to": torch.ones(2).to("emu"),
    "sum": on1.sum(), "result": on1 * 2 + 1, "emu:0": on0, "emu:0 result": on0.exp(),
    "moved": moved, "new_zeros of emu:0": on0.new_zeros(1), "module": linear.weight,
    "module output": linear(on1), "Tensor.emu()": torch.ones(1).emu(),
}
with torch.accelerator.device_index(0):
    placed["in device_index(0)"] = torch.zeros(1, device="emu")
placed["after it"] = torch.zeros(1, device="emu")
with torch.device("meta"):  # transformers reads its device context so: torch.tensor([]).device
    placed["torch.tensor in a meta context"] = torch.tensor([])
    placed["torch.as_tensor in a meta context"] = torch.as_tensor([1.0])
if importlib.util.find_spec("deepspeed"):
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    deepspeed = [accelerator.current_device(), accelerator.current_device_name(),
                 accelerator.device_count()]
else:
    deepspeed = None
seen = dict(
    count=torch.accelerator.device_count(), installed_on=installed_on,
    current=[torch.accelerator.current_device_index(), torch.emu.current_device(),
             str(emulation.install())],
    bare=on1.device == torch.device("emu", 1), placed={k: str(v.device) for k, v in placed.items()},
    moved_copies=moved.data_ptr() != on0.data_ptr() and moved.tolist() == on0.tolist(),
    kept=on1.to("emu:1") is on1,
    refused={
        "emu:0 + emu:1": error(lambda: on0 + on1),
        "emu:0 @ emu:1":
            error(lambda: torch.ones(2, 2, device="emu:0") @ torch.ones(2, 2, device="emu")),
        "emu:1[emu:0 idx]": error(lambda: on1[torch.tensor([0], device="emu:0")]),
    },
    copied=on1.clone().copy_(on0 * 3).tolist(),
    bad_index=error(lambda: torch.accelerator.set_device_index(2)),
    bad_factory=error(lambda: torch.ones(1, device="emu:2")),
    generator=str(torch.Generator("emu").device),
    stream=str(torch.accelerator.current_stream().device),
    deepspeed=deepspeed,
    rank_device=str(devices.rank_device(1)),
)


ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
reference, model = tiny(), tiny().to("emu")
seen["train"] = dict(cpu=train(reference, ids), emu=train(model, ids.to("emu")),
                     param=str(model.lm_head.weight.device))
dist.init_process_group(devices.group_backend(torch.device("emu", 1)),
                        init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh
reference, model = tiny(), tiny().to("emu")
fully_shard(model, mesh=init_device_mesh("emu", (1,)))
seen["fsdp"] = dict(cpu=train(reference, ids), emu=train(model, ids.to("emu")),
                    param=str(model.lm_head.weight.device),
                    local=str(model.lm_head.weight.to_local().device))
dist.destroy_process_group()
report(**seen)
"""

DEEPSPEED = PRELUDE + """
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                  MASTER_PORT=str(20000 + os.getpid() % 20000))
dev = emulation.install()
import deepspeed, torch._dynamo
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM
dist.init_process_group(emulation.GROUP_BACKEND, init_method="file://" + tempfile.mktemp(),
                        rank=0, world_size=1)
deepspeed.init_distributed(dist_backend=emulation.GROUP_BACKEND, auto_mpi_discovery=False)
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                     max_position_embeddings=64, attn_implementation="eager")
seen = dict(accelerator=[get_accelerator().device_name(), get_accelerator().current_device_name(),
                         get_accelerator().communication_backend_name()])
for stage in (1, 3):
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": stage}}
    torch.manual_seed(0)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=None):
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        loss = engine(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    param = next(engine.module.parameters())
    with torch.inference_mode():  # generation gathers ZeRO-3 partitions in inference mode
        inference = error(lambda: engine.module(input_ids=ids.to(engine.device)))
    seen[f"zero{stage}"] = dict(device=str(engine.device), losses=losses,
                                param=[type(param).__name__, str(param.device)],
                                partition=str(getattr(param, "ds_tensor", param).device),
                                inference=inference)
report(**seen)
"""

GUARDS = PRELUDE + """
from torch.utils import backend_registration
setup = backend_registration._setup_privateuseone_for_python_backend
del backend_registration._setup_privateuseone_for_python_backend
missing = error(emulation.install)
backend_registration._setup_privateuseone_for_python_backend = setup
weight = torch.ones(2, requires_grad=True)
(weight * 2).sum().backward()
late = error(emulation.install)
os.environ[emulation.ENV_VAR] = "0"
report(missing=missing, late=late, from_env=emulation.install_from_env() is None,
       installed=emulation.is_installed(), version=torch.__version__)
"""


#: What a child's device count and devices are read from: set only where a test sets them.
DEVICE_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "PEERFLOW_EMULATED_DEVICES",
              "PEERFLOW_EMULATE_ACCELERATOR")


def _env(**overrides: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in DEVICE_ENV}
    return {**env, "PYTHONPATH": str(ROOT), **overrides}


def _run(code: str, *args: str, timeout: float = 240, **env: str) -> dict:
    return _run_all([(code, args, env)], timeout=timeout)[0]


def _run_all(children: list[tuple[str, tuple[str, ...], dict[str, str]]],
             timeout: float = 240) -> list[dict]:
    """Runs the children (code, argv, environment) at once; their reports, in order."""
    running = [subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(**env))
               for code, args, env in children]
    try:
        outputs = [child.communicate(timeout=timeout) for child in running]
    finally:
        for child in running:
            if child.poll() is None:
                child.kill()
    return [_result(child.returncode, *output) for child, output in zip(running, outputs)]


def _result(returncode: int, stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT:")]
    assert returncode == 0 and lines, f"child failed ({returncode}):\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT:"):])


@pytest.fixture(scope="module")
def mixes() -> dict:
    return _run(MIXES)


def test_refuses_every_host_device_mix_cuda_refuses(mixes):
    refused = mixes["refused"]
    assert len(refused) == 13
    assert all(refused.values()), [name for name, message in refused.items() if not message]
    two_devices = ("Expected all tensors to be on the same device, but found at least two "
                   "devices, emu:0 and cpu!")
    for name in ("cpu.mul_(dev)", "dev.index_put_(cpu_values)", "embedding(cpu_ids)",
                 "dev + cpu", "where(mask, dev, cpu)"):
        assert refused[name] == two_devices, name
    assert refused["cumsum(dev, out=cpu)"] == (
        "Expected out tensor to have device emu:0, but got cpu instead")
    assert refused["equal(cpu, dev)"] == (
        "Expected all tensors to be on the same device, but got other is on emu:0, different "
        "from other tensors on cpu (when checking argument in method wrapper_CUDA__equal)")
    assert refused["dev @ cpu"].endswith(
        "but got mat2 is on cpu, different from other tensors on emu:0 (when checking "
        "argument in method wrapper_CUDA_mm)")
    assert refused["cpu[dev_idx]"] == ("indices should be either on cpu or on the same "
                                       "device as the indexed tensor (cpu)")
    for name in ("repeat_interleave(dev, cpu_repeats)", "index_select(dev, cpu_idx)"):
        assert "but got index is on cpu" in refused[name], name
    assert "wrapper_CUDA_cat" in refused["cat([dev, cpu])"]
    assert "but got target is on cpu" in refused["cross_entropy(dev, cpu_targets)"]


def test_legal_mixes_compute_real_values_and_the_device_looks_like_an_accelerator(mixes):
    seen = mixes
    assert seen["legal"] == {
        "dev * cpu_scalar": [2.0, 2.0, 2.0], "dev[cpu_idx]": [1.0, 1.0],
        "dev[cpu_mask]": [0.0, 2.0], "cumsum(out=dev)": [0.0, 1.0, 2.0, 3.0],
        "cumsum(out=empty dev)": [[3], [1.0, 2.0, 3.0]],
        "index assignment": [0.0, 3.0, 0.0, 3.0, 0.0], "nonzero": [1, 3],
        "repeat_interleave(dev, dev)": [1.0, 1.0, 1.0, 1.0], "index_add": [1.0, 0.0, 1.0],
        "equal(dev, dev)": True, "cpu.copy_(dev)": [3.0, 3.0, 3.0], "item": 10,
    }
    assert seen["device"] == "emu:0" and seen["same"] and seen["installed"]
    assert seen["available"] and seen["is_emu"] and seen["accelerator"] == "emu"
    assert (seen["count"], seen["index"], seen["set_index"]) == (1, 0, None)
    assert "Invalid device ordinal 1" in seen["bad_index"]
    assert seen["cuda"] is False
    assert seen["types"] == ["EmulatedTensor", "Tensor", "EmulatedTensor"]
    assert seen["devices"] == ["emu:0", "cpu", "emu:0", "emu:0"]
    assert seen["generated"] is True
    assert seen["cpu_generator"] == "Expected a 'emu' device type for generator but found 'cpu'"
    assert seen["backend"] == "emunccl"
    assert seen["inference"] == [None, False, True]


@pytest.mark.slow  # default keeper: test_the_emulated_run_reproduces_the_cpu_run (fsdp)
def test_llama_and_fsdp2_train_on_the_device_as_on_the_cpu():
    seen = _run(TRAINING)
    for name, run in seen["runs"].items():
        assert run["tied"] and run["param"] == ["EmulatedTensor", "emu:0"], name
        if name.startswith("eager"):
            assert run["emu"] == run["cpu"] and run["gap"] == 0.0, name
        else:  # SDPA takes its math path on the device, the CPU's flash kernel on the host
            assert run["emu"] == pytest.approx(run["cpu"], abs=1e-5), name
            assert run["gap"] < 1e-5, name
    assert seen["saved"]
    fsdp = seen["fsdp"]
    assert fsdp["param"] == ["DTensor", "emu:0"]
    assert fsdp["emu"] == fsdp["cpu"] and fsdp["gap"] == 0.0


# "ranks share a device" is slow-tier: "one device per rank" keeps the collective contract
@pytest.mark.parametrize("emulated_devices", ["", pytest.param("1", marks=pytest.mark.slow)],
                         ids=["one device per rank", "ranks share a device"])
def test_collectives_carry_device_tensors_and_refuse_host_ones_on_a_device_only_group(
        tmp_path, emulated_devices):
    """Rank r on emu:r over emunccl (as on a GPU node), or both on emu:0 over gloo."""
    store = str(tmp_path / "store")
    seen = _run_all([(COLLECTIVES, (str(rank), "2", store), dict(
        PEERFLOW_EMULATE_ACCELERATOR="1", LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank),
        PEERFLOW_EMULATED_DEVICES=emulated_devices)) for rank in range(2)])
    shared = emulated_devices == "1"
    for rank, ranks in enumerate(seen):
        device = "emu:0" if shared else f"emu:{rank}"
        assert ranks["device"] == device and ranks["placed"] == [device]
        assert ranks["share"] is shared
        assert ranks["backend"] == ("cpu:gloo,emu:gloo" if shared else "cpu:gloo,emu:emunccl")
        assert ranks["all_reduce"] == [3.0, 3.0, 3.0]
        assert ranks["max"] == [1.0, 10.0]
        assert ranks["host"] == [[3.0, 3.0], "cpu"]
        assert ranks["broadcast"] == [0.0, 1.0, 2.0]
        assert ranks["all_gather"] == [0.0, 1.0]
        assert ranks["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert ranks["reduce_scatter_tensor"] == [2.0 * rank]
        assert ranks["all_to_all_single"] == [float(rank), 10.0 + rank]
        assert ranks["functional"] == [[2.0, 2.0], device]
        assert ranks["new_group"] == [2.0, 2.0]
        assert ranks["device_only"] == 2.0
        assert ranks["host_on_device_only"] == "No backend type associated with device type cpu"
        assert ranks["objects"] == [{"from": 0}]
    assert seen[1]["recv"] == [42.0, 43.0]


@pytest.mark.slow  # default keeper: tests/device/test_emulated_runs.py layer 3 [deepspeed]
def test_deepspeed_places_zero_engines_on_the_device():
    pytest.importorskip("deepspeed")
    seen = _run(DEEPSPEED)
    assert seen["accelerator"] == ["emu", "emu:0", "cpu:gloo,emu:emunccl"]
    for stage in ("zero1", "zero3"):
        assert seen[stage]["device"] == "emu:0", stage
        assert seen[stage]["param"] == ["EmulatedTensor", "emu:0"], stage
        assert seen[stage]["partition"] == "emu:0", stage
        assert seen[stage]["inference"] is None, stage
        assert len(seen[stage]["losses"]) == 2 and seen[stage]["losses"][1] < \
            seen[stage]["losses"][0], stage


def test_refuses_a_torch_without_its_apis_and_an_install_after_the_first_backward():
    seen = _run(GUARDS)
    assert seen["version"] in seen["missing"]
    assert "_setup_privateuseone_for_python_backend" in seen["missing"]
    assert "after this process's first backward pass" in seen["late"]
    assert seen["from_env"] and not seen["installed"]


def test_the_device_count_follows_the_local_world_size_or_its_override():
    local_world = dict(PEERFLOW_EMULATE_ACCELERATOR="1", LOCAL_WORLD_SIZE="3", LOCAL_RANK="2")
    three, shared, four, refused = _run_all([
        (COUNTS, (), local_world),
        (COUNTS, (), {**local_world, "PEERFLOW_EMULATED_DEVICES": "1"}),
        (COUNTS, (), {**local_world, "PEERFLOW_EMULATED_DEVICES": "4"}),
        (COUNTS, (), {**local_world, "PEERFLOW_EMULATED_DEVICES": "none"}),
    ])
    assert three == dict(count=3, share=False, device="emu:2", backend="cpu:gloo,emu:emunccl")
    assert shared == dict(count=1, share=True, device="emu:0", backend="cpu:gloo,emu:gloo")
    assert four == dict(count=4, share=False, device="emu:2", backend="cpu:gloo,emu:emunccl")
    assert "$PEERFLOW_EMULATED_DEVICES must be a whole number" in refused["failed"]


def test_each_index_is_a_device_of_its_own_and_a_model_trains_on_emu_1():
    seen = _run(INDICES, PEERFLOW_EMULATED_DEVICES="2")
    assert seen["count"] == 2 and seen["installed_on"] == "emu:0"
    assert seen["current"] == [1, 1, "emu:1"] and seen["bare"]
    assert seen["placed"] == {
        "ones": "emu:1", "tensor": "emu:1", "to": "emu:1", "sum": "emu:1", "result": "emu:1",
        "emu:0": "emu:0", "emu:0 result": "emu:0", "moved": "emu:1",
        "new_zeros of emu:0": "emu:0", "module": "emu:1", "module output": "emu:1",
        "Tensor.emu()": "emu:1", "in device_index(0)": "emu:0", "after it": "emu:1",
        "torch.tensor in a meta context": "meta", "torch.as_tensor in a meta context": "meta"}
    assert seen["moved_copies"] and seen["kept"] and seen["copied"] == [3.0, 3.0]
    refused = seen["refused"]
    assert refused["emu:0 + emu:1"] == ("Expected all tensors to be on the same device, but "
                                        "found at least two devices, emu:0 and emu:1!")
    assert refused["emu:0 @ emu:1"] == (
        "Expected all tensors to be on the same device, but got mat2 is on emu:1, different "
        "from other tensors on emu:0 (when checking argument in method wrapper_CUDA_mm)")
    assert refused["emu:1[emu:0 idx]"] == ("indices should be either on cpu or on the same "
                                           "device as the indexed tensor (emu:1)")
    assert seen["bad_index"].startswith("Invalid device ordinal 2: the emulated accelerator "
                                        "has 2 devices")
    assert "Invalid device ordinal 2" in seen["bad_factory"]
    assert seen["generator"] == seen["stream"] == "emu:1"
    assert seen["deepspeed"] in (None, [1, "emu:1", 2])
    assert seen["rank_device"] == "emu:1"
    assert seen["train"]["param"] == "emu:1"
    assert seen["train"]["emu"] == seen["train"]["cpu"]
    fsdp = seen["fsdp"]
    assert (fsdp["param"], fsdp["local"]) == ("emu:1", "emu:1")
    assert fsdp["emu"] == fsdp["cpu"]


LOAD = PRELUDE + """
dev = emulation.install()
path = os.path.join(tempfile.mkdtemp(), "state.pt")
host = {"w": torch.arange(4.0), "state": {0: {"step": torch.tensor(3.0)}}}
torch.save(host, path)
on_device = torch.load(path, map_location=dev)  # the optimizer-state restore (issue 51)
by_name = torch.load(path, map_location="emu:0", weights_only=True)
saved_on_device = os.path.join(tempfile.mkdtemp(), "device.pt")
torch.save({"w": torch.arange(4.0, device=dev)}, saved_on_device)
report(devices=[str(on_device["w"].device), str(on_device["state"][0]["step"].device),
                str(by_name["w"].device)],
       values=on_device["w"].cpu().tolist(),
       saved_on_device=[str(torch.load(saved_on_device)["w"].device),
                        str(torch.load(saved_on_device, map_location="cpu")["w"].device),
                        str(torch.load(saved_on_device, weights_only=True)["w"].device)],
       dict_map=error(lambda: torch.load(path, map_location={"cpu": "emu:0"})))
"""


def test_torch_load_onto_the_device_moves_tensors_instead_of_crashing():
    """Issue 51: `torch.load(..., map_location=torch.device("emu", 0))` exited 139."""
    seen = _run(LOAD)
    assert seen["devices"] == ["emu:0", "emu:0", "emu:0"]
    assert seen["values"] == [0.0, 1.0, 2.0, 3.0]
    assert seen["saved_on_device"] == ["emu:0", "cpu", "emu:0"]  # as CUDA's checkpoints load
    assert "takes a map_location that names one device" in seen["dict_map"]
