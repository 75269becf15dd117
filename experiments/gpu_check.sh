#!/usr/bin/env bash
# One-GPU check (written for one H200; < 8 minutes): the GPU tests, the kernel microbenchmark and the GPU
# throughput sweep, everything logged to OUTDIR/log.txt and the results written under OUTDIR.
#
#   bash experiments/gpu_check.sh OUTDIR
#
# Needs a Python with this project's requirements and a CUDA jax. If `jax` has no GPU backend the script runs
#   pip install -r requirements.txt "jax[cuda12]==0.10.2"
# (the only install it does; several GB of CUDA wheels). A machine without registry access needs those wheels
# carried in: point PIP_FIND_LINKS at a folder of them (pip then also gets --no-index).
# GPU_CHECK_DRY_RUN=1 runs the same steps on the CPU with the tiny variants (to check the script itself).
set -uo pipefail
OUT=${1:?usage: bash experiments/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DRY=${GPU_CHECK_DRY_RUN:-0}
declare -A RC
T0=$(date +%s)
step() {  # step NAME SECONDS CMD...: run with a time limit, record the exit status
  local name=$1 limit=$2; shift 2
  echo "=== [$name] $(date '+%H:%M:%S') limit ${limit}s: $*"
  local t=$(date +%s)
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  RC[$name]=$?
  echo "=== [$name] rc=${RC[$name]} in $(( $(date +%s) - t ))s"
}

echo "gpu_check $(date) in $(pwd); python $PY; dry run: $DRY; git $(git rev-parse --short HEAD 2>/dev/null)"
command -v nvidia-smi >/dev/null && nvidia-smi

PYTEST_MODE=()
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  VARIANT=test
  PYTEST_MODE=(--collect-only)  # the CPU runs these tests in CI already; the dry run checks they are found
else
  if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
    echo "jax has no GPU backend here: installing the CUDA build (see the header)"
    EXTRA=()
    [ -n "${PIP_FIND_LINKS:-}" ] && EXTRA=(--no-index --find-links "$PIP_FIND_LINKS")
    step install 240 "$PY" -m pip install -q "${EXTRA[@]}" -r requirements.txt "jax[cuda12]==0.10.2"
  fi
  export JAX_PLATFORMS=cuda     # tests/conftest.py only sets "cpu" when nothing is set
  VARIANT=gpu
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"
"$PY" -m pip freeze 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda|flax|numpy)" || true

# 1. GPU tests: compiled Pallas kernels (they skip on a CPU backend) and the offloaded runtime.
export SPECACHE_JAX_GPU_TESTS=1
step tests 150 "$PY" -m pytest -q "${PYTEST_MODE[@]}" --junitxml="$OUT/tests.xml" tests/test_kernels_*.py \
    tests/test_offload.py

# 2. Kernel microbenchmark (experiments/kernel_bench.py).
if [ -f experiments/kernel_bench.py ]; then
  step kernel_bench 75 "$PY" -m experiments.kernel_bench --out="$OUT/kernels.json"
else
  echo "experiments/kernel_bench.py is not in this checkout: skipped"; RC[kernel_bench]=skipped
fi

# 3. Throughput sweep, GPU variant (its config starts no cell after max_seconds = 150 and records the rest as
#    skipped; the overlap measurement follows).
step throughput 240 "$PY" -m experiments.throughput --config=configs/throughput.py:$VARIANT \
    --config.out="$OUT/throughput_$VARIANT"

echo "=== summary after $(( $(date +%s) - T0 ))s"
for k in "${!RC[@]}"; do echo "$k rc=${RC[$k]}"; done | sort | tee "$OUT/summary.txt"
ls -la "$OUT"
