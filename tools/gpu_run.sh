#!/usr/bin/env bash
# One GPU session: install (pydantic wheels carried in .whl/), GPU tests, then the benchmark.
#   bash tools/gpu_run.sh tests          # conformance + CUDA-graph tests
#   bash tools/gpu_run.sh bench [args]   # tools/bench.py with args
set -uo pipefail
export PYTHONUNBUFFERED=1
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
what=${1:-tests}; shift || true
out=${OUT:-/tmp/out}
mkdir -p "$out"
case "$what" in
  tests) python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rf "$@" tests/test_conformance.py tests/test_triton_gpu.py 2>&1 | tee "$out/gpu_tests.log" | tail -40
         grep CONFORMANCE "$out/gpu_tests.log" >/dev/null 2>&1 || python3 -m pytest -q -m gpu -o addopts="" -s tests/test_conformance.py -k "kernel_conforms_on_gpu" 2>/dev/null | grep CONFORMANCE > "$out/conformance.txt" ;;
  bench) python3 tools/bench.py --out "$out" "$@" ;;
  *) echo "usage: $0 tests|bench" >&2; exit 2 ;;
esac
