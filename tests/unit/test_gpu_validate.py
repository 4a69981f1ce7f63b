"""The GPU validation kit's dry run (issue 17): wheel folder, command list, report format.

The kit itself needs a GPU; here it plans, checks its inputs and writes a report whose
checks are all `planned`, which the same validator as a real run accepts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_dry_run_plans_every_check_within_the_budget(tmp_path) -> None:
    kit = _kit()
    proc, report = _dry_run(tmp_path, tmp_path / "no-wheels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert kit.validate_report(report) == []
    names = [c["name"] for c in report["checks"]]
    assert {"gpu_tests", "conformance_hf", "quickstart_bf16", "resume", "deepspeed_zero3",
            "megatron", "nccl_pair", "cuda_ipc_pair", "realsize"} <= set(names)
    assert all(c["status"] == "planned" for c in report["checks"])
    assert report["summary"] == {"planned": len(names)}
    assert sum(c["budget_s"] for c in report["checks"]) + kit.INSTALL_BUDGET_S <= 540
    wheels = _kit("gpu_validate_wheels").WHEELS
    assert set(report["install"]["missing"]) == set(wheels)  # none brought
    log = (tmp_path / "out" / "gpu-validate.log").read_text()
    assert "[plan] realsize" in log and "scripts/gpu_validate_checks.py realsize" in log


def test_dry_run_accepts_a_complete_wheel_folder(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    kit = _kit("gpu_validate_wheels")
    for name, _ in {n for items in kit.WHEELS.values() for n in items}:
        suffix = ".tar.gz" if name == "deepspeed" else "-py3-none-any.whl"
        dist = name.replace("-", "_")
        (wheels / f"{dist}-1.0{suffix}").write_bytes(b"x" * 1000)
    proc, report = _dry_run(tmp_path, wheels)
    assert proc.returncode == 0, proc.stdout
    assert report["install"]["missing"] == {}
    assert report["install"]["fits_transfer_limit"]
    assert report["install"]["bytes"] == 1000 * len(report["install"]["files"])


def test_report_validator_and_skips_name_the_reason(tmp_path) -> None:
    kit = _kit()
    _, report = _dry_run(tmp_path, tmp_path / "none")
    report["checks"][0]["status"] = "great"
    report["checks"][1]["budget_s"] = 10_000
    problems = kit.validate_report(report)
    assert any("'great': not one of" in p for p in problems)
    assert any("exceed 540 s" in p for p in problems)
    with open(tmp_path / "log", "w") as log:
        runner = kit.Runner(out=tmp_path, wheels=tmp_path, log=log)
        check = next(c for c in kit.plan_checks(tmp_path) if c.name == "megatron")
        entry = kit.run_check(runner, check, {"megatron": ["megatron-core"]})
    assert entry["status"] == "skipped"
    assert entry["figures"]["reason"] == "wheels missing for megatron: megatron-core"


def test_checks_program_lists_its_checks() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_validate_checks.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "env,nccl-pair,ipc-pair,realsize" in proc.stderr
