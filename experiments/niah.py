"""Needle in a Haystack over context lengths × depths × cache methods; prints the table (the main job).

  python -m experiments.niah --config=configs/niah.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import niah, launch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/niah.py", "experiment config",
                                          lock_config=True)


def main(argv):
  launch.run_sweep("niah", _CONFIG.value, niah.run, argv, mesh_ok=True, unit="cell(s)")


if __name__ == "__main__":
  app.run(main)
