#!/usr/bin/env bash
# The project's GPU check (see scripts/gpu_check.py): ~8 minutes on one NVIDIA GPU, no network.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" scripts/gpu_check.py "$@"
