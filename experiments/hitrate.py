"""SpeCache hit rates (exact next token; top-k rows) per layer over a long generation.

  python -m experiments.hitrate --config=configs/hitrate.py      # see the config for variants
"""
import shlex
import sys

import jax
from absl import app, logging
from ml_collections import config_flags

from specache_jax.experiments_lib import hitrate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/hitrate.py", "experiment config",
                                          lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  logging.info("devices: %s", jax.devices())
  command = shlex.join(["python", "-m", "experiments.hitrate"] + sys.argv[1:])
  result = hitrate.run(config, command=command, log=logging.info)
  print(result.table)
  print(f"\n{result.computed} cell(s) computed, {result.skipped} reused, {result.seconds:.0f} s; "
        f"written to {config.output_dir}/")


if __name__ == "__main__":
  app.run(main)
