"""RULER's 13 tasks per cache method; prints the per-task table (the paper's rebuttal layout).

  python -m experiments.ruler --config=configs/ruler.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import launch, ruler

_CONFIG = config_flags.DEFINE_config_file("config", "configs/ruler.py", "experiment config", lock_config=True)


def main(argv):
  launch.run_sweep("ruler", _CONFIG.value, ruler.run, argv, mesh_ok=True, unit="sample(s)")


if __name__ == "__main__":
  app.run(main)
