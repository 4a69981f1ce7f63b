#!/usr/bin/env bash
# GPU validation kit (docs/gpu-validation.md): on a bare GPU machine with a preinstalled
# CUDA PyTorch, install from a local wheel folder only what the image lacks, then PeerFlow;
# run the checks in parallel lanes, each under its own time budget (realsize and the
# coordinator benchmark alone afterwards), and write OUT/gpu-validate.json + .log.
#
#   bash scripts/gpu-validate.sh --wheels wheels --out "$OUT"        # on the GPU machine
#   bash scripts/gpu-validate.sh --dry-run --wheels wheels             # anywhere: checks the
#                                                                      # wheel folder, the plan
#                                                                      # and the report format
#   bash scripts/gpu-validate.sh --prepare-wheels wheels               # on a CPU machine with
#                                                                      # a package registry
# Only the standard library is needed to start: the runner installs what the checks import.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_validate.py "$@"
