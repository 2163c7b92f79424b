#!/usr/bin/env bash
# The GPU checks: the gpu-marked tests, then a short GPU benchmark. Under 5 minutes on one GPU.
#   tests/gpu/run.sh            (from the repository root, with .venv built on a CUDA machine;
#                                `pip install -e '.[gpu]'` adds CuPy for the raw-kernel path)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: nothing to run")'
timeout 240 "$PY" -m pytest tests/gpu -m gpu -q -o addopts="-ra -p no:cacheprovider"
timeout 60 "$PY" -m tests.gpu.bench_gpu
