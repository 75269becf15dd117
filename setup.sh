#!/usr/bin/env bash
# Creates .venv and installs the project offline-from-registries. `bash setup.sh --test` adds the test peers.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if [ "${1:-}" = "--test" ]; then REQ=requirements-test.txt; else REQ=requirements.txt; fi
.venv/bin/python -m pip install -q -r "$REQ" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location\|BuildBackendWarning\|expand.py\|return\|^ *$" || true
.venv/bin/python -c "import jax, specache_jax; print('specache_jax ready: jax', jax.__version__, jax.default_backend())"
