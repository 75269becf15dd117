"""Ours vs HF transformers on the same model, prompts and contexts, in one interleaved run (+ machine limits and
our step time vs context).

  python -m experiments.peer_bench --config=configs/peer_bench.py      # see the config for variants
"""
import os

from absl import app, logging
from ml_collections import config_flags

from specache_jax.bench import peer, peer_report, report
from specache_jax.experiments_lib import launch
from specache_jax.experiments_lib.store import atomic_write_text

_CONFIG = config_flags.DEFINE_config_file("config", "configs/peer_bench.py", "benchmark config", lock_config=True)


def main(argv):
  if launch.start(argv) is not None:
    raise app.UsageError("experiments.peer_bench runs on one device; drop --mesh")
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  command = launch.command_line("peer_bench")

  def save_partial(result):       # a run stopped midway still leaves its finished cells in <out>.json
    result["meta"]["command"] = command
    atomic_write_text(config.out + ".json", report.dumps(result))

  with launch.bad_input_as_usage():
    result = peer.run(config, log=logging.info, progress=save_partial)
  result["meta"]["command"] = command
  plot_name = ""
  if config.plot and result.get("scaling"):
    os.makedirs(os.path.dirname(config.plot) or ".", exist_ok=True)
    peer_report.plot(result, config.plot)
    plot_name = os.path.relpath(config.plot, os.path.dirname(config.out) or ".")
  atomic_write_text(config.out + ".json", report.dumps(result))
  text = peer_report.markdown(result, plot_name)
  atomic_write_text(config.out + ".md", text + "\n")
  print(text)


if __name__ == "__main__":
  app.run(main)
