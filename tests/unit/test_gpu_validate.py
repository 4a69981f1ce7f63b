"""The GPU validation kit on a CPU machine (issues 17, 32): its dry run, its time plan in
lanes, its wheel folder (preparation and the missing-only install), its runner, and the
figures realsize reads.

The kit itself needs a GPU; here it plans, checks its inputs and writes a report whose
checks are all `planned`, which the same validator as a real run accepts. Nothing here
downloads anything: pip is replaced wherever the kit would call it."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Every check the 2026-11-27 H200 run reported (docs/gpu-validation.md, "Results")
#: and the ones issue 32 added: the coordinator benchmark and four two-rank checks.
H200_CHECKS = {"env", "conformance_hf", "conformance_fsdp", "conformance_deepspeed",
               "conformance_megatron", "gpu_tests", "nccl_pair", "cuda_ipc_pair",
               "quickstart_bf16", "resume", "deepspeed_zero3", "megatron", "realsize"}
ISSUE32_CHECKS = {"bench_coordinator", "quickstart_dp2", "split_pair", "async_pair",
                  "coordinator_pair"}


def _kit(name: str = "gpu_validate"):
    """One of the kit's modules (`gpu_validate` puts `scripts/` on the path for the rest)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _dry_run(tmp_path, wheels):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-validate.sh"), "--dry-run",
                           "--wheels", str(wheels), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    report = json.loads((tmp_path / "out" / "gpu-validate.json").read_text())
    return proc, report


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A minimal wheel: a dist-info with METADATA (no code)."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", meta)
    return path


def test_dry_run_plans_every_check_within_the_command_limit(tmp_path) -> None:
    kit = _kit()
    report_kit = _kit("gpu_validate_report")
    proc, report = _dry_run(tmp_path, tmp_path / "no-wheels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert kit.validate_report(report) == []
    names = [c["name"] for c in report["checks"]]
    assert H200_CHECKS | ISSUE32_CHECKS <= set(names)
    assert len(names) == len(set(names))
    assert all(c["status"] == "planned" for c in report["checks"])
    assert report["summary"] == {"planned": len(names)}
    plan = report["plan"]
    assert plan["total_s"] <= report_kit.TOTAL_BUDGET_S < report_kit.COMMAND_LIMIT_S == 600
    wheels = _kit("gpu_validate_wheels").WHEELS
    assert set(report["install"]["missing"]) == set(wheels)  # none brought
    log = (tmp_path / "out" / "gpu-validate.log").read_text()
    assert "realsize" in log and "scripts/gpu_validate_checks.py realsize" in log
    assert "bench coordinator --nprocs 2,4,8 --runs 7" in log


def test_lanes_fit_the_budget_and_keep_realsize_alone(tmp_path) -> None:
    kit = _kit()
    checks = kit.plan_checks(tmp_path)
    by_name = {c.name: c for c in checks}
    plan = kit.plan_times([{"phase": c.phase, "lane": c.lane, "budget_s": c.budget_s}
                           for c in checks])
    assert kit.plan_problems(plan) == [] and kit.order_problems(checks) == []
    assert kit.check_commands(checks) == []
    assert plan["total_s"] <= kit.TOTAL_BUDGET_S
    for row in plan["phases"]:  # no lane runs past its phase, so none past the limit
        assert max(row["lanes"].values()) == row["budget_s"]
    # realsize has the GPU to itself; the coordinator benchmark the CPUs, beside the
    # one-process GPU benchmark of the train step
    assert [c.name for c in checks if c.phase == by_name["realsize"].phase] == ["realsize"]
    assert {c.name for c in checks if c.phase == by_name["bench_coordinator"].phase} == {
        "bench_coordinator", "bench_train"}
    assert len({c.lane for c in checks if c.phase == 0}) >= 3
    # budgets from the H200's figures: about 1.6 x the longest complete run
    for check in checks:
        if check.measured_s is not None:
            assert check.budget_s >= 1.5 * check.measured_s, check.name
    # resume needs quickstart_bf16's checkpoint: same lane, after it
    assert by_name["resume"].lane == by_name["quickstart_bf16"].lane
    assert names_before(checks, "resume") >= {"quickstart_bf16"}
    # a lane over the limit, or a dependency in another lane, is refused
    assert kit.plan_problems(kit.plan_times([{"phase": 0, "lane": "A", "budget_s": 10_000}]))
    bad = [kit.Check("a", "a", 1, ["-m", "pytest"], "A"),
           kit.Check("b", "b", 1, ["-m", "pytest"], "B", requires=("a",))]
    assert any("runs beside it" in p for p in kit.order_problems(bad))


def names_before(checks, name):
    index = [c.name for c in checks].index(name)
    return {c.name for c in checks[:index]}


def test_two_rank_checks_share_one_gpu(tmp_path) -> None:
    checks = {c.name: c for c in _kit().plan_checks(tmp_path)}
    for name in ("quickstart_dp2", "split_pair", "async_pair", "coordinator_pair"):
        argv = checks[name].argv
        assert argv[argv.index("--nprocs") + 1] == "2", name
        assert 2 <= int(next(a.split("=")[1] for a in argv if a.startswith("run.steps="))) <= 3
    assert "runtime.placement=split" in checks["split_pair"].argv
    assert {"runtime.mode=async", "runtime.placement=split"} <= set(checks["async_pair"].argv)
    assert "runtime.coordinator_transport=gloo" in checks["coordinator_pair"].argv
    assert not any(a.startswith("runtime.placement") for a in checks["quickstart_dp2"].argv)


def test_train_checks_configs_plan(tmp_path, capsys) -> None:
    """Every `peerflow train` check's config and overrides plan (`peerflow plan`): keys,
    option sections and placements exist as the kit spells them."""
    from peerflow.cli import main

    for check in _kit().plan_checks(tmp_path):
        argv = check.argv
        if argv[:3] != ["-m", "peerflow", "train"] or "--resume" in argv:
            continue
        sets = [a for i, a in enumerate(argv) if i and argv[i - 1] == "--set"]
        nprocs = argv[argv.index("--nprocs") + 1]
        code = main(["plan", argv[3], "--nprocs", nprocs, "--format", "json",
                     *[a for s in sets for a in ("--set", s)]])
        assert code == 0, (check.name, capsys.readouterr().err)
    capsys.readouterr()


def test_dry_run_accepts_a_complete_wheel_folder(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    kit = _kit("gpu_validate_wheels")
    for wheel in kit.all_wheels().values():
        suffix = "-1.0.tar.gz" if wheel.source else "-1.0-py3-none-any.whl"
        (wheels / f"{wheel.name.replace('-', '_')}{suffix}").write_bytes(b"x" * 1000)
    proc, report = _dry_run(tmp_path, wheels)
    assert proc.returncode == 0, proc.stdout
    assert report["install"]["missing"] == {}
    assert report["install"]["fits_transfer_limit"]
    assert report["install"]["bytes"] == 1000 * len(report["install"]["files"])


def test_prepare_wheels_asks_pip_for_manylinux_2_28(tmp_path, monkeypatch) -> None:
    """Megatron-core 0.16.1 has only manylinux_2_24/2_28 wheels for cp312 (H200 run)."""
    kit = _kit("gpu_validate_wheels")
    calls = []
    real_run = subprocess.run

    def fake_run(argv, *args, **kwargs):
        if "pip" not in argv:  # git ls-files, for the tree's size
            return real_run(argv, *args, **kwargs)
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(kit.subprocess, "run", fake_run)
    assert kit.prepare_wheels(tmp_path / "w") == 1  # nothing came: the folder is incomplete
    binary, source = calls
    assert binary[1:4] == ["-m", "pip", "download"] and "--no-deps" in binary
    assert "--only-binary=:all:" in binary and "--no-binary=:all:" not in binary
    assert binary[binary.index("--python-version") + 1] == "3.12"
    platforms = {binary[i + 1] for i, a in enumerate(binary) if a == "--platform"}
    assert {"manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
            "manylinux2014_x86_64"} <= platforms
    assert "megatron-core==0.16.1" in binary
    for spec in ("cattrs==26.2.1", "attrs==26.1.0", "typing-extensions==4.16.0",
                 "pydantic==2.14.4", "pydantic-core==2.50.5"):
        assert spec in binary
    assert "--no-deps" in source and "--no-binary=:all:" in source
    assert "deepspeed==0.19.8" in source and "deepspeed==0.19.8" not in binary
    assert "--platform" not in source


def test_wheel_list_holds_what_the_h200_image_lacked() -> None:
    tomllib = pytest.importorskip("tomllib")
    kit = _kit("gpu_validate_wheels")
    wheels = kit.all_wheels()
    lacked = {"cattrs", "pebble", "jsonschema", "referencing", "rpds-py",
              "jsonschema-specifications", "math-verify", "latex2sympy2-extended",
              "antlr4-python3-runtime", "datasets", "dill", "multiprocess",
              "typing-extensions", "attrs", "pydantic", "pydantic-core", "annotated-types",
              "typing-inspection", "hjson", "megatron-core", "deepspeed"}
    assert lacked <= set(wheels)
    assert kit.satisfies("4.15.0", wheels["typing-extensions"].need) is False
    assert kit.satisfies("4.16.0", wheels["typing-extensions"].need)
    assert kit.satisfies("25.3.0", wheels["attrs"].need) is False
    assert wheels["deepspeed"].source
    # every runtime dependency of peerflow is brought, or is one of the image's large ones
    image = {"torch", "transformers", "tokenizers", "safetensors", "tensorboard", "matplotlib"}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {kit.norm(kit.Requirement(d).name) for d in deps}
    assert names - image <= set(wheels), names - image - set(wheels)


def test_install_plan_takes_only_what_the_image_lacks(tmp_path) -> None:
    kit = _kit("gpu_validate_wheels")
    folder = {n: tmp_path / f"{n.replace('-', '_')}-{v}-py3-none-any.whl" for n, v in {
        "pytest": "9.2.0", "pluggy": "1.7.0", "attrs": "26.1.0", "cattrs": "26.2.1",
        "typing-extensions": "4.16.0", "pydantic": "2.14.4", "pydantic-core": "2.50.5",
        "datasets": "5.2.0", "rich": "15.0.0"}.items()}
    image = {"pytest": "9.1.1", "pluggy": "1.6.0", "Attrs": "25.3.0",
             "typing_extensions": "4.15.0", "pydantic-core": "2.41.0", "rich": "15.0.0",
             "fsspec": "2027.1.0"}
    requires = {"cattrs": ["attrs>=25.4.0", "typing-extensions>=4.14.0",
                           "msgpack>=1.0.5; extra == 'msgpack'"],
                "pydantic": ["pydantic-core==2.50.5", "typing-extensions>=4.16.0"],
                "datasets": ["fsspec<=2026.9.0,>=2023.1.0", "dill<0.4.2"],
                "pytest": ["pluggy>=1.7"]}
    plan = kit.plan_install(folder, image, requires)
    assert set(plan.install) == {"attrs", "cattrs", "typing-extensions", "pydantic",
                                 "pydantic-core", "datasets"}
    assert plan.install["attrs"].startswith("installed 25.3.0 fails >=25.4")
    assert plan.install["cattrs"] == "absent"
    assert "pydantic requires pydantic-core==2.50.5" in plan.install["pydantic-core"]
    # the image's own copies stay, even where the folder has a newer one
    assert plan.kept == {"pytest": "9.1.1", "pluggy": "1.6.0", "rich": "15.0.0"}
    assert [u for u in plan.unsatisfied if "fsspec" in u]  # neither image nor folder meets it
    assert [u for u in plan.unsatisfied if "dill" in u]
    assert not [u for u in plan.unsatisfied if "msgpack" in u]  # an extra's requirement


def test_install_plan_reads_requirements_from_the_wheels(tmp_path) -> None:
    kit = _kit("gpu_validate_wheels")
    _fake_wheel(tmp_path, "cattrs", "26.2.1", ["attrs>=25.4.0", "pymongo; extra == 'bson'"])
    _fake_wheel(tmp_path, "attrs", "26.1.0")
    found = kit.find_wheels(tmp_path)
    assert kit.requires_dist(found["cattrs"]) == ["attrs>=25.4.0", "pymongo; extra == 'bson'"]
    # attrs 24 satisfies the kit's own list only through cattrs' requirement: taken for it
    plan = kit.plan_install(found, {"attrs": "26.0.0"})
    assert set(plan.install) == {"cattrs"}
    plan = kit.plan_install(found, {"attrs": "24.2.0", "cattrs": "26.2.1"})
    assert set(plan.install) == {"attrs"}


def test_install_runs_pip_on_the_missing_files_only(tmp_path, monkeypatch) -> None:
    kit = _kit()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "pytest", "9.2.0")
    _fake_wheel(wheels, "pebble", "5.2.3")
    _fake_wheel(wheels, "megatron-core", "0.16.1")
    (wheels / "deepspeed-0.19.8.tar.gz").write_bytes(b"")
    image = {"pytest": "9.1.1", "pebble": "5.2.3"}
    monkeypatch.setattr(kit, "installed_distributions", lambda: dict(image))
    calls = []

    def fake_run(self, argv, budget, env=None, name=""):
        calls.append((name, argv, env, budget))
        return 0, "", 0.1

    monkeypatch.setattr(kit.Runner, "run", fake_run)
    with open(tmp_path / "log", "w") as log:
        runner = kit.Runner(out=tmp_path, wheels=wheels, log=log)
        entry, unavailable = kit.install(runner, kit.check_wheel_folder(wheels))
    by_name = {name: (argv, env) for name, argv, env, _ in calls}
    assert set(by_name) == {"wheels", "sources", "peerflow"}
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
    for argv, _ in by_name.values():
        assert argv[:6] == pip
    files = [Path(a).name for a in by_name["wheels"][0] if a.endswith(".whl")]
    assert files == ["megatron_core-0.16.1-py3-none-any.whl"]  # not pytest, not pebble
    argv, env = by_name["sources"]
    assert argv[-1].endswith("deepspeed-0.19.8.tar.gz") and env["DS_BUILD_OPS"] == "0"
    assert "--no-build-isolation" in argv
    assert by_name["peerflow"][0][-2:] == ["-e", str(ROOT)]
    assert sum(b for *_, b in calls) <= kit.INSTALL_BUDGET_S
    assert entry["status"] == "passed" and set(entry["installed"]) == {"megatron-core",
                                                                       "deepspeed"}
    assert entry["kept"] == {"pytest": "9.1.1", "pebble": "5.2.3"}
    # the fake pip installed nothing: what the image lacks stays unavailable, by group
    assert "megatron-core" in unavailable["megatron"]


def test_runner_lanes_requirements_and_timeouts(tmp_path) -> None:
    """Lanes run their checks in order; a failed requirement skips its dependant; a check
    past its budget is stopped with every process it started (a new session too)."""
    kit = _kit()
    pidfile = tmp_path / "grandchild.pid"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)'], start_new_session=True); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    figures = "print('GPU_VALIDATE_FIGURES {\"answer\": 42}')"
    checks = [kit.Check("ok", "p", 60, ["-c", figures], "A"),
              kit.Check("fails", "p", 60, ["-c", "raise SystemExit(1)"], "A"),
              kit.Check("after_fail", "p", 60, ["-c", "pass"], "A", requires=("fails",)),
              kit.Check("unsupported", "p", 60, ["-c", "raise SystemExit(3)"], "B"),
              kit.Check("hangs", "p", 2, ["-c", hang], "B"),
              kit.Check("later", "p", 60, ["-c", "pass"], "C", phase=1, requires=("ok",)),
              kit.Check("megatron", "p", 60, ["-c", "pass"], "C", phase=1,
                        needs=("megatron",))]
    with open(tmp_path / "log", "w") as log:
        runner = kit.Runner(out=tmp_path, wheels=tmp_path, log=log)
        entries = {e["name"]: e for e in kit.run_phases(runner, checks,
                                                        {"megatron": ["megatron-core"]})}
    assert {n: e["status"] for n, e in entries.items()} == {
        "ok": "passed", "fails": "failed", "after_fail": "skipped",
        "unsupported": "unsupported", "hangs": "timeout", "later": "passed",
        "megatron": "skipped"}
    assert entries["ok"]["figures"] == {"answer": 42}
    assert entries["after_fail"]["figures"]["reason"] == "needs fails to pass first (failed)"
    assert entries["megatron"]["figures"]["reason"] == ("wheels missing for megatron: "
                                                        "megatron-core")
    assert (tmp_path / "logs" / "hangs.log").is_file()
    pid = int(pidfile.read_text())
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z"), state  # killed (a zombie until its new parent reaps it)
    report = kit.build_report(False, {}, list(entries.values()), None)
    assert [p for p in kit.validate_report(report) if "budget" in p or "plan" in p] == []


def test_report_validator_names_bad_entries(tmp_path) -> None:
    kit = _kit()
    _, report = _dry_run(tmp_path, tmp_path / "none")
    report["checks"][0]["status"] = "great"
    report["checks"][1]["budget_s"] = 10_000
    problems = kit.validate_report(report)
    assert any("'great': not one of" in p for p in problems)
    assert any(f"over the kit's {kit.TOTAL_BUDGET_S} s" in p for p in problems)
    del report["checks"][2]["lane"]
    assert any("['lane'] must be a str" in p for p in kit.validate_report(report))


def _safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header = json.dumps({"__metadata__": {"format": "pt"}, **{
        name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
        for name, shape in shapes.items()}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def test_realsize_figures_from_metrics_and_mfu(tmp_path) -> None:
    checks = _kit("gpu_validate_checks")
    _safetensors(tmp_path / "model.safetensors", {"embed": [100, 8], "w": [8, 8]})
    params = checks.count_parameters(tmp_path)
    assert params == 864
    rows = [{"step": 1, "time/generate": 30.0, "time/train_actor": 4.0,
             "time/sync_weights": 1.5, "tokens/total": 12000.0},
            {"step": 2, "time/generate": 20.0, "time/train_actor": 2.0,
             "time/sync_weights": 0.5, "tokens/total": 12288.0, "time/checkpoint": 9.0,
             "weight_sync/wire_s": 0.2}]
    figures = checks.realsize_figures(rows, 1_500_000_000, "NVIDIA H200", 40 * 2**30)
    assert (figures["generate_s"], figures["train_s"], figures["weight_sync_s"]) == (
        20.0, 2.0, 0.5)
    assert figures["train_mfu"] == round(6 * 1.5e9 * 12288 / 2.0 / 989e12, 4)
    assert figures["peak_gpu_gib"] == 40.0 and figures["peak_bf16_tflops"] == 989.0
    assert [s["step"] for s in figures["steps"]] == [1, 2]
    assert figures["steps"][1]["checkpoint_s"] == 9.0
    for device, peak in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 SXM5 80GB", 989.0),
                         ("NVIDIA H200", 989.0)):
        assert checks.peak_bf16_tflops(device)[0] == peak, device
    for device in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB"):
        unknown = checks.realsize_figures(rows, 1_500_000_000, device, 0)
        assert unknown["train_mfu"] is None and device in unknown["train_mfu_reason"]
    assert checks.train_mfu(10, 0, 0.0, "NVIDIA H200")[0] is None


def test_realsize_reads_metrics_peerflow_writes() -> None:
    """The names realsize reads are the ones the worker writes (`time/<node>` for the
    GRPO graph's nodes, token totals, weight-sync phases)."""
    checks = _kit("gpu_validate_checks")
    docs = (ROOT / "peerflow" / "outputs" / "metrics.py").read_text()
    sources = "\n".join(p.read_text() for p in (ROOT / "peerflow").rglob("*.py"))
    for key in checks.REALSIZE_KEYS.values():
        if key.startswith("time/") and key != "time/step":
            assert f"`{key[len('time/'):]}`" in docs, key
        else:
            assert key in docs or f'"{key}"' in sources, key
    assert 'f"time/{name}"' in (ROOT / "peerflow" / "worker" / "loop.py").read_text()


def test_checks_program_lists_its_checks() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_validate_checks.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "env,nccl-pair,ipc-pair,realsize" in proc.stderr


@pytest.mark.skipif(not os.environ.get("PEERFLOW_KIT_WHEELS"),
                    reason="set PEERFLOW_KIT_WHEELS to a prepared wheel folder")
def test_a_prepared_folder_is_complete_and_fits() -> None:
    """By hand, after `--prepare-wheels DIR`: PEERFLOW_KIT_WHEELS=DIR pytest -k prepared."""
    kit = _kit("gpu_validate_wheels")
    report = kit.check_wheel_folder(Path(os.environ["PEERFLOW_KIT_WHEELS"]))
    assert report["missing"] == {} and report["fits_transfer_limit"]


def test_moe_r3_check_is_planned_and_passes_only_on_full_agreement(tmp_path) -> None:
    """The `moe_r3` check runs `peerflow bench moe --device cuda`; its figures pass with
    agreement 1.0 and r3 closer to the rollout than native routing, and fail otherwise."""
    kit = _kit()
    checks = {c.name: c for c in kit.plan_checks(tmp_path)}
    assert checks["moe_r3"].argv[1:] == ["moe-r3"] and checks["moe_r3"].phase == 0
    programs = _kit("gpu_validate_checks")
    from peerflow.bench import moe

    parser = __import__("argparse").ArgumentParser()
    moe.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--layers", "2", "--prompts", "8"])
    result = moe.run(args)  # the bench on the CPU
    figures, passed = programs.moe_r3_figures(result)
    assert passed and figures["agreement"] == 1.0 and figures["device"] == "cpu"
    assert figures["mean_abs_logprob_diff_r3"] < figures["mean_abs_logprob_diff_off"]
    result["r3"]["moe/replay_no_overlap"] = 0.01  # one replayed route in 100 disjoint
    assert programs.moe_r3_figures(result) == ({**figures, "agreement": 0.99}, False)


def test_vllm_moe_r3_check_needs_every_fed_token_routed_and_full_agreement(tmp_path) -> None:
    """The `vllm_moe_r3` check (its own lane: vLLM beside the other lanes) runs `peerflow
    bench moe --rollout vllm`; it passes only when every sample has routes, every fed token
    has one, and r3 agrees fully. The rule is checked on the hf engine's routes here."""
    checks = {c.name: c for c in _kit().plan_checks(tmp_path)}
    assert checks["vllm_moe_r3"].argv[1:] == ["vllm-moe-r3"]
    assert checks["vllm_moe_r3"].lane not in {c.lane for c in checks.values()
                                              if c.name != "vllm_moe_r3"}
    programs = _kit("gpu_validate_checks")
    from peerflow.bench import moe

    parser = __import__("argparse").ArgumentParser()
    moe.add_arguments(parser)
    result = moe.run(parser.parse_args(["--layers", "2", "--prompts", "4", "--n", "2"]))
    figures, passed = programs.vllm_moe_r3_figures(result)
    assert passed and figures["samples_with_routes"] == figures["samples"] == 8
    assert figures["fed_tokens_without_route"] == 0 and figures["rollout_engine"] == "hf"
    result["routes"]["fed_tokens_without_route"] = 1
    assert not programs.vllm_moe_r3_figures(result)[1]
    result["routes"].update(fed_tokens_without_route=0, samples_with_routes=7)
    assert not programs.vllm_moe_r3_figures(result)[1]
