"""Decode step time of every cache method on a prefilled cache (ratios to full) and device bytes.

  python -m experiments.caches_bench --config=configs/caches_bench.py      # see the config for variants
"""
import shlex
import sys

import jax
from absl import app, logging
from ml_collections import config_flags

from specache_jax.bench import caches, models, report
from specache_jax.experiments_lib.store import atomic_write_text

_CONFIG = config_flags.DEFINE_config_file("config", "configs/caches_bench.py", "benchmark config",
                                          lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  logging.info("devices: %s", jax.devices())
  model = models.load(config.model, config.dtype, config.seed)
  result = caches.run(config, model, log=logging.info)
  result["meta"]["command"] = shlex.join(["python", "-m", "experiments.caches_bench"] + sys.argv[1:])
  atomic_write_text(config.out + ".json", report.dumps(result))
  text = report.caches_markdown(result)
  atomic_write_text(config.out + ".md", text + "\n")
  print(text)


if __name__ == "__main__":
  app.run(main)
