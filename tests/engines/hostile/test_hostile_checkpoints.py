"""A crafted pickle in a real DeepSpeed and a real Megatron checkpoint: resume, eval and
export refuse it, naming the file and `--trust-checkpoint`, and its payload never runs.

One gloo rank per engine (`hostile_worker.py`) writes step 1 of a run directory with the
run driver's `save_step`, resumes it, then plants `tests.helpers.hostile`'s payload (a
`__reduce__` running `touch MARKER`) in the actor's optimiser file and forges the
manifest. Here, `peerflow export` runs on that run directory as the CLI does; with
`--trust-checkpoint` the payload runs, which shows the file is a live attack.

Slow (about a minute): the default run keeps the contract with the crafted-copy tests of
tests/engines/deepspeed/test_deepspeed_engine.py and tests/engines/megatron/
test_megatron_engine.py (`load_checkpoint`, `saved_shards`) and the `verify` /
`newest_verified` refusals of tests/unit/test_checkpoint_pickles.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.deepspeed.trainlib import build_model  # noqa: E402
from tests.helpers.gloo import run_script  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("hostile_worker.py")
BACKENDS = ("deepspeed", "megatron")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("hostile-llama"), "llama", tied=True)


@pytest.fixture(scope="module", params=BACKENDS)
def attacked(request, tiny, tmp_path_factory) -> tuple[str, Path, dict]:
    """`(backend, OUT_DIR, the worker's BACKEND.json)` after the attack."""
    pytest.importorskip("deepspeed" if request.param == "deepspeed" else "megatron.core")
    out = tmp_path_factory.mktemp(f"hostile-{request.param}")
    run_script(WORKER, str(out), tiny, request.param, nprocs=1, timeout=300)
    return request.param, out, json.loads((out / f"{request.param}.json").read_text())


def _write_run_config(run: Path, model_path: str, backend: str) -> None:
    """The run directory's config.yaml, as `peerflow train` leaves it (export reads it)."""
    root = Path(__file__).resolve().parents[3]
    config = yaml.safe_load((root / "examples" / "quickstart.yaml").read_text())
    config["model"] = {"path": model_path, "dtype": "float32"}
    config["trainer"] = {"backend": backend, "lr": 0.01}
    config["runtime"]["nprocs"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def test_resume_and_load_refuse_the_crafted_file_by_name(attacked):
    backend, out, result = attacked
    if backend == "megatron":
        assert result["pickles"] == [], "Megatron's checkpoint is safetensors + JSON only"
        assert result["old_format_loads"], "PeerFlow 0.1.0's optimiser .pt loads untrusted"
    else:  # DeepSpeed's own files are pickles that the restricted unpickler accepts
        assert any(name.endswith("_optim_states.pt") for name in result["pickles"])
    assert (result["resumed_step"], result["version"]) == (1, 1)
    for refusal in (result["resume_refusal"], result["load_refusal"]):
        assert refusal is not None, f"{backend}: the crafted checkpoint was loaded"
        assert result["target"] in refusal and "--trust-checkpoint" in refusal
    assert not result["marker_after_refusals"], f"{backend}: the payload ran"
    assert not (out / f"{backend}-pwned").exists()


def test_export_refuses_the_crafted_file_by_name_and_trust_runs_it(
        attacked, tiny, tmp_path, capsys, monkeypatch):
    from peerflow.checkpoint.pickles import TRUST_ENV
    from peerflow.cli import main

    backend, out, result = attacked
    monkeypatch.setenv(TRUST_ENV, "0")  # restored (unset) afterwards, whatever main sets
    run = out / "run"
    _write_run_config(run, tiny, backend)
    marker = out / f"{backend}-pwned"
    assert main(["export", str(run), str(tmp_path / "model")]) == 1
    error = capsys.readouterr().err
    assert result["target"] in error and "--trust-checkpoint" in error
    assert not marker.exists() and not (tmp_path / "model").exists()
    if backend == "deepspeed":  # zero_to_fp32 unpickles the optimiser file: the payload runs
        with pytest.raises(ValueError, match="is not a zero checkpoint"):
            main(["export", str(run), str(tmp_path / "trusted"), "--trust-checkpoint"])
        assert marker.exists(), "--trust-checkpoint loads unrestricted"
    else:  # Megatron's export reads only its safetensors shards: the payload stays shut
        from peerflow.adapters.megatron.engine import MegatronTrainEngine
        from tests.engines.deepspeed.trainlib import export_checkpoint

        monkeypatch.setenv(TRUST_ENV, "1")  # (the tiny model has no tokenizer to export)
        export_checkpoint(MegatronTrainEngine, str(run / "checkpoints" / "step_000001" /
                                                   "actor"), tiny, str(tmp_path / "trusted"))
        assert not marker.exists()
