"""SpeCache's κ selection on this CPU: `lax.top_k` vs the blocked exact top-k (experiments/lib/bench/topk.py).

  python -m experiments.topk_bench --config=configs/topk_bench.py      # see the config for variants
"""
from absl import app
from ml_collections import config_flags

from experiments.lib import launch
from experiments.lib.bench import topk

_CONFIG = config_flags.DEFINE_config_file("config", "configs/topk_bench.py", "benchmark config", lock_config=True)


def main(argv):
  launch.start_one_device("topk_bench", argv)
  topk.run(_CONFIG.value, command=launch.command_line("topk_bench"))


if __name__ == "__main__":
  app.run(main)
