"""Prefill on this CPU: blockwise causal attention vs the dense reference, alone and inside SmolLM2-135M
(experiments/lib/bench/prefill.py).

  python -m experiments.prefill_bench --config=configs/prefill_bench.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import launch
from experiments.lib.bench import prefill

_CONFIG = config_flags.DEFINE_config_file("config", "configs/prefill_bench.py", "benchmark config",
                                          lock_config=True)


def main(argv):
  launch.start_one_device("prefill_bench", argv)
  with launch.bad_input_as_usage():
    prefill.run(_CONFIG.value, command=launch.command_line("prefill_bench"))


if __name__ == "__main__":
  app.run(main)
