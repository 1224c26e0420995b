#!/usr/bin/env bash
# Wheels of a newer transformers for the GPU machine, which has no network and an older one (tools/gpu_run.sh puts
# .whl-tf/ first on the path when it is carried): transformers and the tokenizers it pins in .whl-tf/, and
# huggingface_hub with the packages it needs beyond the image's in .whl-tf/hub/ (installed only where the image's
# hub is too old for that transformers).
#   bash tools/prepare_transformers.sh 5.24.0      # then run(..., carry=[".whl", ".whl-tf"])
set -euo pipefail
version=${1:?usage: $0 TRANSFORMERS_VERSION}
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
python3 -m pip download -q "${target[@]}" -d .whl-tf "$tokenizers"
python3 -m pip download -q "${target[@]}" -d .whl-tf/hub huggingface_hub httpx2 httpcore2 truststore anyio click hf-xet
ls .whl-tf .whl-tf/hub
