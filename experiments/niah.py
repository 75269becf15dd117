"""Needle in a Haystack over context lengths × depths × cache methods; prints the table (the main job).

  python -m experiments.niah --config=configs/niah.py      # see the config for variants
"""
import shlex
import sys

import jax
from absl import app, logging
from ml_collections import config_flags

from specache_jax.experiments_lib import niah

_CONFIG = config_flags.DEFINE_config_file("config", "configs/niah.py", "experiment config",
                                          lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  logging.info("devices: %s", jax.devices())
  command = shlex.join(["python", "-m", "experiments.niah"] + sys.argv[1:])
  result = niah.run(config, command=command, log=logging.info)
  print(result.table)
  print(f"\n{result.computed} cell(s) computed, {result.skipped} reused, {result.seconds:.0f} s; "
        f"written to {config.output_dir}/")


if __name__ == "__main__":
  app.run(main)
