"""Decode step time of every cache method on a prefilled cache (ratios to full) and device bytes.

  python -m experiments.caches_bench --config=configs/caches_bench.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib.bench import caches, report
from experiments.lib.bench.launch import run_benchmark

_CONFIG = config_flags.DEFINE_config_file("config", "configs/caches_bench.py", "benchmark config",
                                          lock_config=True)


def main(argv):
  run_benchmark("caches_bench", _CONFIG.value, caches.run, report.caches_markdown, argv)


if __name__ == "__main__":
  app.run(main)
