"""One stage of the device check (`experiments/gpu_check.sh` runs every stage with its own time limit; the
stages and their sizes: experiments/lib/bench/gpu_check.py). Flags, not a config file: the lent GPU machine
has no ml_collections. The exit code: 0 ok, 1 a check failed, 124 the stage's deadline (or a signal) stopped it;
OUTDIR/<stage>.json holds what finished either way.

  python -m experiments.gpu_check --stage=smoke --out=OUTDIR --deadline_s=50           # on the lent GPU machine
  python -m experiments.gpu_check --stage=kernels --platform=tpu --out=OUTDIR          # on a TPU VM
  python -m experiments.gpu_check --stage=smoke --out=/tmp/g --dry_run                 # tiny sizes, on the CPU
"""
import sys

from absl import app, flags

from experiments.lib.bench import gpu_check

_STAGE = flags.DEFINE_enum("stage", None, gpu_check.STAGES, "which stage to run", required=True)
_OUT = flags.DEFINE_string("out", None, "output folder (one <stage>.json per stage)", required=True)
_PLATFORM = flags.DEFINE_enum("platform", "gpu", gpu_check.PLATFORMS, "the accelerator the check is for")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "tiny sizes on whatever backend is here (checks the script)")
_DEADLINE = flags.DEFINE_float("deadline_s", 0.0, "the stage's own time limit in seconds (0: none): at it the "
                               "stage records what it finished and stops")


def main(argv):
  del argv
  gpu_check.prepare_environment(_STAGE.value, _PLATFORM.value, _DRY_RUN.value)     # before JAX's backend starts
  sys.exit(gpu_check.run_stage(_STAGE.value, _OUT.value, _DRY_RUN.value, _PLATFORM.value, _DEADLINE.value))


if __name__ == "__main__":
  app.run(main)
