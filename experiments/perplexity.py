"""Perplexity by position bucket for each cache method (teacher forcing through the cache).

  python -m experiments.perplexity --config=configs/perplexity.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import perplexity, launch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/perplexity.py", "experiment config",
                                          lock_config=True)


def main(argv):
  launch.run_sweep("perplexity", _CONFIG.value, perplexity.run, argv, mesh_ok=False, unit="cell(s)")


if __name__ == "__main__":
  app.run(main)
