#!/usr/bin/env bash
# Nightly-style: the tests .ci/run leaves out as `slow` (interpreter cases over kernel code CI
# already runs; the marker's description in pyproject.toml gives the rule), on every core. Run it
# in the dev environment (pip install -e ".[dev]"); extra arguments go to pytest.
#   bash tools/run_slow_tests.sh
#   bash tools/run_slow_tests.sh -k gptq
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python -m pytest -q -p no:cacheprovider -n auto --dist worksteal -m "slow and not gpu" "$@"
rc=$?
echo "slow tests: $((SECONDS - start)) s"
# exit 5 (nothing collected) means the marker lost its tests: a failure, as in .ci/run
if [ "$rc" -eq 5 ]; then echo "pytest collected no slow tests" >&2; exit 1; fi
exit "$rc"
