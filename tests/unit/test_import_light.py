import subprocess
import sys

HEAVY = ("vllm", "sglang", "deepspeed", "megatron", "ray")

CHECK = """
import sys
{body}
heavy = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})
print(','.join(heavy))
"""


def _imported(body: str) -> str:
    code = CHECK.format(body=body, heavy=HEAVY)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_peerflow_imports_no_engine():
    assert _imported("import peerflow") == ""


def test_loading_every_plugin_imports_no_engine():
    body = ("from peerflow.plugins import KINDS, get_plugin_manager\n"
            "pm = get_plugin_manager()\n"
            "[pm.registry(k) for k in KINDS]\n"
            "from peerflow.cli.plugins_cmd import collect\ncollect()")
    assert _imported(body) == ""
