#!/usr/bin/env bash
# The device check on a bare GPU machine: no pip install, no Ray, no network.
# Run from a checkout:  bash deploy/jobs/gpu-check.sh [--skip-tests] [--skip-real-sizes]
# Needs torch (CUDA), transformers, safetensors, tokenizers, pyyaml, pytest; the zoo family
# under $SAGUARO_ZOO_DIR (build it with `saguaro-ray zoo build --preset tiny` where the project
# is installed and copy it over: ~4 MB). Writes the JSON report to ${OUT:-.}/gpu-check.json.
# Measured on an H200 (docs/gpu.md): about 3 minutes.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
pkg=$(mktemp -d)
# workers/ is installed as saguaro_ray.workers (pyproject's package-dir): lay the package out that way
cp -r "$repo/saguaro_ray" "$repo/tests" "$repo/pyproject.toml" "$pkg/"
cp -r "$repo/workers" "$pkg/saguaro_ray/workers"
cd "$pkg"
export PYTHONPATH="$pkg" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 540 python3 -m saguaro_ray.jobs.gpu_check --json "${OUT:-$repo}/gpu-check.json" "$@"
