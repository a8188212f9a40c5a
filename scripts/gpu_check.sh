#!/usr/bin/env bash
# The project's GPU check (see scripts/gpu_check.py): one NVIDIA GPU, no network, a hard budget
# (default 7.5 minutes); it prints its plan first (steps in order of value, each with its cap).
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" scripts/gpu_check.py "$@"
