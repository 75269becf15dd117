"""Low-bit attention over packed codes vs the dequantize-everything path (experiments/lib/bench/packed.py).

  python -m experiments.packed_bench --config=configs/packed_bench.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import launch
from experiments.lib.bench import packed

_CONFIG = config_flags.DEFINE_config_file("config", "configs/packed_bench.py", "benchmark config",
                                          lock_config=True)


def main(argv):
  launch.start_one_device("packed_bench", argv)
  packed.run(_CONFIG.value, command=launch.command_line("packed_bench"))


if __name__ == "__main__":
  app.run(main)
