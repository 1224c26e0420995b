#!/usr/bin/env bash
# Wheels of a newer transformers for the GPU machine, which has no network and an older one (tools/gpu_run.sh puts
# .whl-tf/ first on the path when it is carried): transformers and the tokenizers it pins in .whl-tf/, and
# huggingface_hub with the packages it needs beyond the image's in .whl-tf/hub/ (installed only where the image's
# hub is too old for that transformers); compressed-tensors and the loguru it needs beside them (transformers' own
# loading of compressed-tensors checkpoints, which tools/bench_model.py compares with). With a second argument, a
# git directory of github.com/huggingface/kernels-community: .whl-tf/hub-kernels/ holds its finegrained-fp8
# package (the kernel transformers' FineGrainedFP8 experts download from the Hub at run time) for
# tools/bench_model.py --hub-kernels.
#   bash tools/prepare_transformers.sh 5.24.0 [KERNELS_COMMUNITY_GIT_DIR]  # then run(..., carry=[".whl", ".whl-tf"])
set -euo pipefail
version=${1:?usage: $0 TRANSFORMERS_VERSION [KERNELS_COMMUNITY_GIT_DIR]}
kernels_repo=${2:-}
target=(--python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: --no-deps)
rm -rf .whl-tf && mkdir -p .whl-tf/hub
python3 -m pip download -q "${target[@]}" -d .whl-tf "transformers==$version"
tokenizers=$(python3 - .whl-tf/transformers-*.whl <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
pins = [line.split(":", 1)[1].strip() for line in wheel.read(meta).decode().splitlines()
        if line.startswith("Requires-Dist: tokenizers") and "extra ==" not in line]
print(pins[0].replace(" ", "") if pins else "tokenizers")
PY
)
python3 -m pip download -q "${target[@]}" -d .whl-tf "$tokenizers" compressed-tensors loguru
python3 -m pip download -q "${target[@]}" -d .whl-tf/hub huggingface_hub httpx2 httpcore2 truststore anyio click hf-xet
if [ -n "$kernels_repo" ]; then
  # the Hub's build of this Triton-only kernel is its torch-ext package plus an _ops module the kernel builder
  # writes (the namespace its torch.library ops register under)
  commit=$(git --git-dir="$kernels_repo" rev-parse HEAD)
  mkdir -p .whl-tf/hub-kernels
  git --git-dir="$kernels_repo" archive HEAD finegrained-fp8/torch-ext/finegrained_fp8 \
    | tar -x --strip-components=2 -C .whl-tf/hub-kernels
  cat > .whl-tf/hub-kernels/finegrained_fp8/_ops.py <<'PY'
import torch

ops = torch.ops._finegrained_fp8_local


def add_op_namespace_prefix(op_name: str) -> str:
    return f"_finegrained_fp8_local::{op_name}"
PY
  printf '{"finegrained-fp8": {"package": "finegrained_fp8", "source": "github.com/huggingface/kernels-community@%s"}}\n' \
    "$commit" > .whl-tf/hub-kernels/kernels.json
fi
ls .whl-tf .whl-tf/hub
