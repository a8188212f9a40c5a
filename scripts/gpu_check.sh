#!/usr/bin/env bash
# The project's GPU check (see scripts/gpu_check.py and docs/gpu.md): one NVIDIA GPU, no network,
# a hard budget (default 9 minutes, inside a 10-minute command); it runs a preflight, prints its
# plan, and writes every figure to the folder given with --out, e.g.
#   scripts/gpu_check.sh --out gpu_out
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" scripts/gpu_check.py "$@"
