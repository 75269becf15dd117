"""Where the needle's rows rank in the low-bit scores, per layer (issue 14's miss anatomy).

  python -m experiments.needle_rank --config=configs/needle_rank.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import launch, needle_rank

_CONFIG = config_flags.DEFINE_config_file("config", "configs/needle_rank.py", "experiment config",
                                          lock_config=True)


def main(argv):
  launch.run_sweep("needle_rank", _CONFIG.value, needle_rank.run, argv, mesh_ok=False, unit="cell(s)")


if __name__ == "__main__":
  app.run(main)
