"""SpeCache hit rates (exact next token; top-k rows) per layer over a long generation.

  python -m experiments.hitrate --config=configs/hitrate.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import hitrate, launch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/hitrate.py", "experiment config",
                                          lock_config=True)


def main(argv):
  launch.run_sweep("hitrate", _CONFIG.value, hitrate.run, argv, mesh_ok=False, unit="cell(s)")


if __name__ == "__main__":
  app.run(main)
