#!/usr/bin/env bash
# One call on a GPU machine: install (pydantic wheels carried in .whl/), GPU tests, then the benchmark.
#   bash tools/gpu_run.sh tests [args]   # every GPU test: conformance, kernels, producers' fixtures
#   bash tools/gpu_run.sh tests --resume [args]  # the rest, after cp <earlier call's gpu_tests.jsonl> $OUT/
#   bash tools/gpu_run.sh bench [args]   # tools/bench.py with args
#   bash tools/gpu_run.sh model [args]   # tools/bench_model.py with args (whole models beside transformers)
#   bash tools/gpu_run.sh decode [args]  # tools/bench_decode.py with args (decode and alignment timings)
#   bash tools/gpu_run.sh untuned [args] # tools/bench_untuned.py with args (shapes nobody tuned; $OUT/untuned.jsonl)
#   bash tools/gpu_run.sh tune [args]    # tools/tune.py with args, into kernels/configs (copied to $OUT)
#   bash tools/gpu_run.sh profile [args] # tools/profile_ncu.py with args (Nsight Compute counters per kernel;
#        --peer triton|marlin: vLLM's GEMMs beside ours, carry .peer)
#   bash tools/gpu_run.sh peer triton|marlin "SCHEME_SPEC ..."  # vLLM's own MoE kernels, then tools/bench.py,
#        on the same GPU in this call, and the ratio table (carry .peer and .whl: tools/prepare_peer.sh makes them)
set -uo pipefail
export PYTHONUNBUFFERED=1
# a warm machine keeps the wheels installed by an earlier call: use them rather than install again
[ -d /tmp/site/pydantic ] && export PYTHONPATH=/tmp/site
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# a newer transformers than the image's, where .whl-tf/ is carried (tools/prepare_transformers.sh makes it): first on
# the path for the whole call (the image's huggingface_hub serves it; .whl-tf/hub/ holds a newer one where not)
if [ -d .whl-tf ]; then
  # a warm machine installed an earlier call's wheels: install again where this call carries others
  wheels=$(cd .whl-tf && ls *.whl)
  if [ "$wheels" != "$(cat /tmp/tf/.wheels 2>/dev/null)" ]; then
    rm -rf /tmp/tf && python3 -m pip install -q --no-index --no-deps --target /tmp/tf .whl-tf/*.whl || exit 1
    echo "$wheels" > /tmp/tf/.wheels
  fi
  if ! PYTHONPATH="/tmp/tf:${PYTHONPATH:-}" python3 -c "import transformers" 2>/dev/null && [ -d .whl-tf/hub ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/tf .whl-tf/hub/*.whl || exit 1
  fi
  export PYTHONPATH="/tmp/tf${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
what=${1:-tests}; shift || true
out=${OUT:-/tmp/out}
mkdir -p "$out"
case "$what" in
  tests) # each finished test goes to $out/gpu_tests.jsonl as it ends (tools/pytest_progress.py): a call cut
         # off by its time limit keeps what it ran; --resume (the earlier call's log copied to $out first)
         # runs only the tests that log does not hold as passed. GPU_TEST_WORKERS pytest workers (default
         # 6: more ran test_triton_gpu out of memory on an H100), one CPU thread each (the conformance
         # cases' weights are made on the CPU, once per run of cases sharing them). pytest is
         # interrupted after GPU_TESTS_SECONDS (default 540: a device call runs 600 s at most), so that
         # it reports what finished, and killed 30 s later if it has not stopped; the log holds every
         # finished test either way, and the summary still prints.
         resume=(); [ "${1:-}" = "--resume" ] && { resume=(--progress-resume); shift; }
         # every test marked gpu (those needing two GPUs skip on one), unless test paths are given
         targets=(tests); for arg in "$@"; do [[ $arg == tests/* ]] && targets=(); done
         PYTHONPATH="tools${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
           timeout -s INT -k 30 "${GPU_TESTS_SECONDS:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider \
           -n "${GPU_TEST_WORKERS:-6}" -p pytest_progress --progress-log "$out/gpu_tests.jsonl" \
           "${resume[@]}" -o addopts="" -rf "$@" \
           "${targets[@]}" > "$out/gpu_tests.log" 2>&1
         rc=$?
         tail -25 "$out/gpu_tests.log"
         python3 tools/pytest_progress.py "$out/gpu_tests.jsonl"
         exit $rc ;;
  bench) python3 tools/bench.py --out "$out" "$@" ;;
  model) python3 tools/bench_model.py --out "$out" "$@" ;;
  decode) python3 tools/bench_decode.py "$@" | tee "$out/bench_decode.txt"; exit "${PIPESTATUS[0]}" ;;
  untuned) python3 tools/bench_untuned.py --out "$out" "$@" ;;
  profile) python3 tools/profile_ncu.py --out "$out" "$@" ;;
  tune) touch /tmp/tune-start  # only the files this run wrote come back (the lender returns a few files per call)
        python3 tools/tune.py "$@"
        rc=$?
        # with the tables, the measurements of an entry cut off (<table>.partial): put them back in
        # kernels/configs for the next call to go on from there (a finished entry's record is gone)
        mkdir -p "$out/configs" && find kernels/configs \( -name '*.json' -o -name '*.partial' \) -newer /tmp/tune-start \
          -exec cp {} "$out/configs/" \;
        exit $rc ;;
  peer) [ -f .peer/side_by_side.sh ] || { echo "gpu_run.sh peer: no .peer/ here (make it with tools/prepare_peer.sh and carry it)" >&2; exit 2; }
        OUT="$out" bash .peer/side_by_side.sh "$@" ;;
  *) echo "usage: $0 tests|bench|model|decode|untuned|tune|profile|peer" >&2; exit 2 ;;
esac
