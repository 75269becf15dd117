"""LongBench predictions and official scores per task per cache method.

  python -m experiments.longbench --config=configs/longbench.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import longbench, launch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/longbench.py", "experiment config",
                                          lock_config=True)


def main(argv):
  launch.run_sweep("longbench", _CONFIG.value, longbench.run, argv, mesh_ok=True, unit="prediction(s)")


if __name__ == "__main__":
  app.run(main)
