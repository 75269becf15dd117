#!/usr/bin/env bash
# The one-GPU check, written for the machine as it is lent (../shared/ENVIRONMENT.md: one H200, python3 3.12
# with jax 0.11.x + CUDA preinstalled, no network, no ml_collections/gguf/tfds, nothing over 64 MiB carried).
# Every stage has its own time limit and writes OUTDIR/<stage>.json as it ends (experiments/lib/bench/gpu_check.py);
# the whole script stays under 8 minutes.
#
#   bash experiments/gpu_check.sh OUTDIR              # on the GPU machine
#   bash experiments/gpu_check.sh --dry-run OUTDIR    # every stage at tiny sizes on this CPU (CI runs this)
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:?usage: bash experiments/gpu_check.sh [--dry-run] OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/log.txt") 2>&1
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
declare -A RC
T0=$(date +%s)
step() {  # step NAME SECONDS CMD...: run with a time limit, record the exit status
  local name=$1 limit=$2; shift 2
  # the limits are the GPU machine's; a dry run checks the script on a shared CPU, not its speed
  [ "$DRY" = 1 ] && limit=$(( limit * ${GPU_CHECK_DRY_SLACK:-4} ))
  echo "=== [$name] $(date '+%H:%M:%S') limit ${limit}s: $*"
  local t=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  RC[$name]=$?
  echo "=== [$name] rc=${RC[$name]} in $(( $(date +%s) - t ))s"
}
stage() {  # stage NAME SECONDS [ENV=VALUE ...]: one stage of experiments/gpu_check.py
  local name=$1 limit=$2; shift 2
  local flags=(--stage="$name" --out="$OUT")
  [ "$DRY" = 1 ] && flags+=(--dry_run)
  step "$name" "$limit" env "$@" "$PY" -m experiments.gpu_check "${flags[@]}"
}

echo "gpu_check $(date) in $(pwd); python $PY; dry run: $DRY; git $(git rev-parse --short HEAD 2>/dev/null)"
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
else
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  export JAX_PLATFORMS=cuda     # tests/conftest.py only sets "cpu" when nothing is set
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"

stage smoke 60                                   # first: a broken install shows within a minute
if [ "$DRY" = 1 ]; then
  step kernel_tests 60 "$PY" -m pytest -q --collect-only tests/test_kernels_mixed_attention.py \
      tests/test_kernels_quant_scores.py
else
  step kernel_tests 90 env SPECACHE_JAX_GPU_TESTS=1 "$PY" -m pytest -q -x --junitxml="$OUT/kernel_tests.xml" \
      tests/test_kernels_mixed_attention.py tests/test_kernels_quant_scores.py
fi
stage kernels 75
stage overlap 100
# the paper's A6000 setting: 48 GB of the H200's ~139 GiB
stage throughput 120 XLA_PYTHON_CLIENT_MEM_FRACTION=${GPU_CHECK_MEM_FRACTION:-0.33}

echo "=== summary after $(( $(date +%s) - T0 ))s"
for k in "${!RC[@]}"; do echo "$k rc=${RC[$k]}"; done | sort | tee "$OUT/summary.txt"
ls -la "$OUT"
for k in "${!RC[@]}"; do [ "${RC[$k]}" = 0 ] || exit 1; done
