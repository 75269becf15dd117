"""One stage of the one-GPU check (`experiments/gpu_check.sh` runs every stage with its own time limit; the
stages and their sizes: experiments/lib/bench/gpu_check.py). Flags, not a config file: the lent GPU machine
has no ml_collections.

  python -m experiments.gpu_check --stage=smoke --out=OUTDIR            # on the lent GPU machine
  python -m experiments.gpu_check --stage=smoke --out=/tmp/g --dry_run  # the same code, tiny sizes, on the CPU
"""
from absl import app, flags

from experiments.lib.bench import gpu_check

_STAGE = flags.DEFINE_enum("stage", None, gpu_check.STAGES, "which stage to run", required=True)
_OUT = flags.DEFINE_string("out", None, "output folder (one <stage>.json per stage)", required=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "tiny sizes on whatever backend is here (checks the script)")


def main(argv):
  del argv
  gpu_check.run_stage(_STAGE.value, _OUT.value, _DRY_RUN.value)


if __name__ == "__main__":
  app.run(main)
