"""Generation throughput per cache method, bytes moved per step, and the fetch/compute overlap.

  python -m experiments.throughput --config=configs/throughput.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib.bench import report, throughput
from experiments.lib.bench.launch import run_benchmark

_CONFIG = config_flags.DEFINE_config_file("config", "configs/throughput.py", "benchmark config",
                                          lock_config=True)


def main(argv):
  run_benchmark("throughput", _CONFIG.value, throughput.run, report.throughput_markdown, argv)


if __name__ == "__main__":
  app.run(main)
