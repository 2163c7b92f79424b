#!/usr/bin/env bash
# The GPU checks: the gpu-marked tests, a short GPU benchmark, then make bench's device regime
# on the real device beside the sim model. About 10 minutes on one GPU (the first two parts
# under 5).
#   tests/gpu/run.sh            (from the repository root, with .venv built on a CUDA machine;
#                                `pip install -e '.[gpu]'` adds CuPy for the raw-kernel path)
#   OUT=DIR tests/gpu/run.sh    (where the device regime's results go; default a temporary directory)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: nothing to run")'
timeout 240 "$PY" -m pytest tests/gpu -m gpu -q -o addopts="-ra -p no:cacheprovider"
timeout 60 "$PY" -m tests.gpu.bench_gpu

# The device regime (bench.device_regime) twice, at the same modest sizes: the sim model's
# profile (steps waited off the CPU, no GPU work), then a `spine model make-tiny` llama served
# on CUDA by every layout (its steps real kernels, the host thread waiting on the stream).
# The two side by side say whether the sim stands for a real device where it matters: the
# collapsed/bare ratios, the server CPU per request and the capacity knees.
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
"$PY" -m spine model make-tiny --arch llama --out "$OUT/tiny-llama"
SIZES=(--regimes device --requests 200 --stream-requests 60 --rounds 3 --capacity-step 1.5)
timeout 300 "$PY" -m bench.run "${SIZES[@]}" --out "$OUT/device-sim.json"
timeout 300 "$PY" -m bench.run "${SIZES[@]}" --device-model "$OUT/tiny-llama" --out "$OUT/device-cuda.json"
"$PY" - "$OUT/device-sim.json" "$OUT/device-cuda.json" <<'PYEOF'
import json, sys
for path in sys.argv[1:]:
    results = json.loads(open(path).read())
    regime = results["device_regime"]
    print(f"{regime['profile']}: collapsed/bare {json.dumps(regime['collapsed_vs_bare'])}")
    print(f"  TTFT collapsed/bare {regime['ttft_collapsed_vs_bare']}; server CPU us/request "
          f"{regime['cpu_us_per_request']}; capacity {json.dumps(results['capacity'])}")
    print(f"  targets {regime['targets']}; load average {results['machine'].get('loadavg_device_start')}")
PYEOF
echo "device regime results: $OUT/device-sim.json $OUT/device-cuda.json"
