"""Ours vs HF transformers on the same model, prompts and contexts, in one interleaved run (+ machine limits and
our step time vs context).

  python -m experiments.peer_bench --config=configs/peer_bench.py      # see the config for variants
  python -m experiments.peer_bench --merge=a.json,b.json --config.out=results/peer_cpu   # runs as one report
"""
import json
import os

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.lib import launch
from experiments.lib.bench import peer, peer_report, report
from experiments.lib.store import atomic_write_text

_CONFIG = config_flags.DEFINE_config_file("config", "configs/peer_bench.py", "benchmark config", lock_config=True)
_MERGE = flags.DEFINE_list("merge", [], "result JSONs of earlier runs to merge into one report at config.out "
                           "(a later run's cell replaces an earlier one's; targets recomputed); runs nothing")


def main(argv):
  launch.start_one_device("peer_bench", argv)
  config = _CONFIG.value
  if _MERGE.value:
    results = []
    for path in _MERGE.value:
      if not os.path.isfile(path):
        raise app.UsageError(f"--merge: {path!r} is not a file (expected a peer_bench result JSON)")
      with open(path) as f:
        results.append(json.load(f))
    return _write(config, peer.merge(results, config.targets))
  logging.info("config:\n%s", config)
  command = launch.command_line("peer_bench")

  def save_partial(result):       # a run stopped midway still leaves its finished cells in <out>.json
    result["meta"]["command"] = command
    atomic_write_text(config.out + ".json", report.dumps(result))

  with launch.bad_input_as_usage():
    result = peer.run(config, log=logging.info, progress=save_partial)
  result["meta"]["command"] = command
  _write(config, result)


def _write(config, result):
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
