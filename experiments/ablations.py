"""SpeCache ablations (k, bits, group size, residual length, 1-bit quantizer, speculative fetch, pre-decoding) on
NIAH and perplexity.

  python -m experiments.ablations --config=configs/ablations.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import ablations, launch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/ablations.py", "experiment config",
                                          lock_config=True)


def main(argv):
  launch.run_sweep("ablations", _CONFIG.value, ablations.run, argv, mesh_ok=False, unit="cell(s)")


if __name__ == "__main__":
  app.run(main)
