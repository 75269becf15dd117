"""The XLA:CPU decoding kernels vs XLA on this CPU (experiments/lib/bench/cpu_kernels.py).

  python -m experiments.cpu_kernel_bench --config=configs/cpu_kernel_bench.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import launch
from experiments.lib.bench import cpu_kernels

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu_kernel_bench.py", "benchmark config",
                                          lock_config=True)


def main(argv):
  launch.start_one_device("cpu_kernel_bench", argv)
  with launch.bad_input_as_usage():
    cpu_kernels.run(_CONFIG.value, command=launch.command_line("cpu_kernel_bench"))


if __name__ == "__main__":
  app.run(main)
