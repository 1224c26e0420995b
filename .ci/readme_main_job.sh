#!/usr/bin/env bash
# The README's main job, as a newcomer runs it: a fresh virtual environment, the package without
# extras, the command between README.md's <!-- main-job --> markers run verbatim in a temporary
# copy of the tracked files. Fails on a non-zero exit or on any warning or error on stderr (torch's
# C++ warnings bypass `python -W error`, so stderr is read, not the warnings filter).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# the command: the code block between the markers, comment lines and fences left out
cmd="$(awk '/^<!-- main-job/ {on = 1; next} /^<!-- \/main-job -->/ {on = 0} on' "$root/README.md" \
        | grep -v -e '^```' -e '^[[:space:]]*#' -e '^[[:space:]]*$' || true)"
if [ -z "$cmd" ] || [ "$(printf '%s\n' "$cmd" | wc -l)" -ne 1 ]; then
  echo "README.md: want one command between <!-- main-job --> and <!-- /main-job -->, found:" >&2
  printf '%s\n' "$cmd" >&2
  exit 1
fi

# a copy of the files git knows (the repo's own examples/checkpoints and .venv stay out of it)
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && xargs -0 cp --parents -t "$work")
else
  tar -C "$root" --exclude=./.venv --exclude=./examples/checkpoints --exclude='*.egg-info' -cf - . | tar -C "$work" -xf -
fi
python3 -m venv "$work/.venv-main-job"
. "$work/.venv-main-job/bin/activate"

echo "README main job: $cmd"
set +e
(cd "$work" && bash -c "$cmd") >"$work/stdout.log" 2>"$work/stderr.log"
rc=$?
set -e
cat "$work/stdout.log"
# This machine's pip configuration names index directories that do not exist; pip says so for
# every package it looks up. That is the machine, not the project: those lines alone are dropped.
problems="$(grep -v -E "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" \
              "$work/stderr.log" | grep -i -E 'warning|error|traceback' || true)"
if [ "$rc" -ne 0 ] || [ -n "$problems" ]; then
  echo "README main job failed (exit $rc); its stderr:" >&2
  cat "$work/stderr.log" >&2
  exit 1
fi
echo "README main job: exit 0, no warning on stderr"
