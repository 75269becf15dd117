#!/usr/bin/env bash
# The device check, written for the machine as it is lent (../shared/ENVIRONMENT.md: one H100 80 GB or H200
# 141 GB, python3 3.12 with jax 0.11.x + CUDA preinstalled, no network, nothing over 64 MiB carried), and for a
# TPU VM (--platform=tpu). Every stage has its own limit: the stage stops itself 10 s before it (a deadline inside
# Python), the shell's `timeout` is the backstop; OUTDIR/<stage>.json is rewritten after every check, so a stage
# that is stopped or killed keeps what it finished (experiments/lib/bench/check_record.py). Under 8 minutes.
#
#   bash experiments/gpu_check.sh OUTDIR                       # on the GPU machine
#   bash experiments/gpu_check.sh --platform=tpu OUTDIR        # on a TPU VM
#   bash experiments/gpu_check.sh --dry-run OUTDIR             # every stage at tiny sizes on this CPU (CI runs this)
set -uo pipefail
DRY=0
PLATFORM=gpu
while [ $# -gt 1 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --platform=*) PLATFORM=${1#--platform=} ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
OUT=${1:?usage: bash experiments/gpu_check.sh [--dry-run] [--platform=gpu|tpu] OUTDIR}
case $PLATFORM in gpu|tpu) ;; *) echo "--platform=$PLATFORM: expected gpu or tpu" >&2; exit 2 ;; esac
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
mark_killed() {  # mark_killed NAME RC: a stage killed before it wrote its final status says so in its JSON
  "$PY" - "$OUT/$1.json" "$2" <<'PYEOF'
import json, os, sys
path, rc = sys.argv[1], sys.argv[2]
if os.path.exists(path):
  rep = json.load(open(path))
  if rep.get("status") == "running":
    rep.update(status="killed", error=f"killed by the shell's time limit (rc {rc}) in check {rep.get('current')!r}")
    json.dump(rep, open(path, "w"), indent=1)
else:
  json.dump({"stage": os.path.basename(path)[:-5], "status": "killed", "error": f"no JSON written (rc {rc})"},
            open(path, "w"), indent=1)
PYEOF
}
stage() {  # stage NAME SECONDS [ENV=VALUE ...]: one stage of experiments/gpu_check.py under its time limit
  local name=$1 limit=$2; shift 2
  # the limits are the device's; a dry run checks the script on a shared CPU, not its speed
  [ "$DRY" = 1 ] && limit=$(( limit * ${GPU_CHECK_DRY_SLACK:-4} ))
  local flags=(--stage="$name" --out="$OUT" --platform="$PLATFORM" --deadline_s=$(( limit - 10 )))
  [ "$DRY" = 1 ] && flags+=(--dry_run)
  echo "=== [$name] $(date '+%H:%M:%S') limit ${limit}s"
  local t=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" env "$@" "$PY" -m experiments.gpu_check "${flags[@]}"
  RC[$name]=$?
  case ${RC[$name]} in 124|137|130) mark_killed "$name" "${RC[$name]}" ;; esac
  echo "=== [$name] rc=${RC[$name]} in $(( $(date +%s) - t ))s"
}

echo "gpu_check $(date) in $(pwd); python $PY; platform $PLATFORM; dry run: $DRY; git $(git rev-parse --short HEAD 2>/dev/null)"
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
elif [ "$PLATFORM" = tpu ]; then
  export JAX_PLATFORMS=tpu
else
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  export JAX_PLATFORMS=cuda     # tests/conftest.py only sets "cpu" when nothing is set
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"

stage smoke 60                  # first: a broken install shows within a minute
stage kernel_tests 90
stage kernels 75
stage overlap 100
# throughput on a GPU: device memory capped at the paper's 48 GB from the card's own memory (GPU_CHECK_MEM_FRACTION
# overrides the fraction)
if [ -n "${GPU_CHECK_MEM_FRACTION:-}" ]; then
  stage throughput 120 XLA_PYTHON_CLIENT_MEM_FRACTION="$GPU_CHECK_MEM_FRACTION"
else
  stage throughput 120
fi

echo "=== summary after $(( $(date +%s) - T0 ))s"
for k in "${!RC[@]}"; do echo "$k rc=${RC[$k]}"; done | sort | tee "$OUT/summary.txt"
ls -la "$OUT"
for k in "${!RC[@]}"; do [ "${RC[$k]}" = 0 ] || exit 1; done
