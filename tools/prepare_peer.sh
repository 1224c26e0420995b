#!/usr/bin/env bash
# Prepare, on the CPU machine, what a GPU call needs to time vLLM's own MoE kernels beside ours
# (`bash tools/gpu_run.sh peer ...`): the peer harness scripts and the few files it reads out of the vLLM
# wheel, in .peer/ (git-ignored, carried to the GPU machine), and the pydantic wheels in .whl/.
#   bash tools/prepare_peer.sh HARNESS_DIR [--no-marlin]
# HARNESS_DIR holds vllm_peer_bench.py, marlin_peer_bench.py, compare.py and side_by_side.sh. Nothing of vLLM
# is installed here or on the GPU machine, and it is never a dependency of the package: the wheel (about 340 MB,
# fetched once into $VLLM_WHEEL_DIR, default ~/vllm-0.33.0-wheel) is only read. --no-marlin skips the CUDA
# Marlin library (38 MB compressed) for Triton-only runs, which leaves more of the 64 MiB a call carries.
set -euo pipefail
harness=${1:?usage: prepare_peer.sh HARNESS_DIR [--no-marlin]}
marlin=1; [ "${2:-}" = "--no-marlin" ] && marlin=0
cd "$(dirname "$0")/.."
for f in vllm_peer_bench.py marlin_peer_bench.py compare.py side_by_side.sh; do
  [ -f "$harness/$f" ] || { echo "prepare_peer.sh: $harness/$f: missing (wanted the peer harness folder)" >&2; exit 2; }
done
version=0.33.0
wheels=${VLLM_WHEEL_DIR:-$HOME/vllm-$version-wheel}
mkdir -p "$wheels"
wheel=$(ls "$wheels"/vllm-$version-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: "vllm==$version" -d "$wheels"
  wheel=$(ls "$wheels"/vllm-$version-*.whl | head -1)
fi
rm -rf .peer && mkdir -p .peer/configs
cp "$harness"/{vllm_peer_bench.py,marlin_peer_bench.py,compare.py,side_by_side.sh} .peer/
unzip -p "$wheel" vllm/model_executor/layers/fused_moe/fused_moe.py > .peer/fused_moe.py
unzip -p "$wheel" vllm/_version.py > .peer/vllm_version.py
# vLLM's tuned H100 and H200 tables (the GPUs the peer runs on), the block-fp8 ones ("...,block_shape=[128,128].json") included
unzip -j -o -q "$wheel" 'vllm/model_executor/layers/fused_moe/configs/*H100*' 'vllm/model_executor/layers/fused_moe/configs/*H200*' -d .peer/configs
sha256sum "$wheel" > .peer/WHEEL_SHA256
if [ $marlin = 1 ]; then
  mkdir -p .peer/marlin
  unzip -p "$wheel" vllm/_moe_C_stable_libtorch.abi3.so | xz -T2 -9 > .peer/marlin/_moe_C_stable_libtorch.abi3.so.xz
  unzip -p "$wheel" vllm/_moe_C_stable_libtorch.abi3.so | sha256sum > .peer/marlin/SO_SHA256
fi
# pydantic for the GPU image's Python 3.12, as tools/gpu_run.sh installs it (one version of each, cp312 only)
ls .whl/pydantic_core-*cp312* >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-extensions==4.16.0 typing-inspection==0.4.5
echo "vLLM $version: $(ls .peer/configs | wc -l) tuned H100 and H200 tables, marlin $([ $marlin = 1 ] && echo yes || echo no)"
du -sh .peer .whl
echo "carry [\".peer\", \".whl\"] with: bash tools/gpu_run.sh peer triton|marlin \"SCHEME_SPEC ...\""
