"""`peerflow.train()` and `launch` from a script without `if __name__ == "__main__":`,
from standard input, and a script whose own reward needs the guard (issue 33 item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = textwrap.dedent('''
    import os
    import torch.distributed as dist

    def run(config_path, overrides, run_dir, resume):
        open(os.path.join(run_dir, f"ran{dist.get_rank()}"), "w").close()
''')
# No main guard: multiprocessing imports the caller's __main__ in every worker it starts.
SCRIPT = textwrap.dedent('''
    import sys
    from peerflow.launch import launch
    launch(None, [], sys.argv[-1], None, nprocs=1, launcher="elastic", fault_timeout=30.0,
           entry="apiprog:run", torch_threads=1)
    print("LAUNCHED")
''')


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PEERFLOW_FAULT_STORE",
                "PEERFLOW_LAUNCHER_PID"):
        env.pop(key, None)
    return env


def test_a_script_without_main_guard_and_standard_input_launch_once(tmp_path):
    (tmp_path / "apiprog.py").write_text(PROGRAM)
    (tmp_path / "train.py").write_text(SCRIPT)
    runs = {name: tmp_path / name for name in ("script", "stdin")}
    for path in runs.values():
        path.mkdir()
    procs = {  # both at once: each is mostly a worker starting
        "script": subprocess.Popen([sys.executable, str(tmp_path / "train.py"),
                                    str(runs["script"])], cwd=tmp_path, env=_env(tmp_path),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "stdin": subprocess.Popen([sys.executable, "-", str(runs["stdin"])], cwd=tmp_path,
                                  env=_env(tmp_path), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    }
    outputs = {"stdin": procs["stdin"].communicate(SCRIPT, timeout=300),  # python - <<EOF
               "script": procs["script"].communicate(timeout=300)}
    for name, (out, err) in outputs.items():
        assert procs[name].returncode == 0, (name, err[-3000:])
        assert out.count("LAUNCHED") == 1, (name, out)  # the workers did not launch again
        assert "bootstrapping phase" not in err and "<stdin>" not in err, (name, err[-2000:])
        assert (runs[name] / "ran0").is_file()


def test_a_script_that_defines_its_reward_is_told_what_to_add(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f'''
        import peerflow

        def score(response, example):
            return float(response.strip() == example["answer"])

        peerflow.train({str(ROOT / "examples" / "quickstart.yaml")!r},
                       overrides={{"run.steps": 1}}, reward_fn=score)
    '''))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1
    assert f"{script}:7: peerflow.train() runs at the top level" in proc.stderr, proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
    assert not (tmp_path / "runs").exists()  # no run directory left behind
