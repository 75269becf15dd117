"""The body of the benchmark launchers (`experiments/caches_bench.py`, `throughput.py`, ...): flags -> the model
-> the benchmark -> <out>.json and <out>.md."""
from __future__ import annotations

import jax
from absl import logging

from experiments.lib import launch, report as exp_report
from experiments.lib.bench import models, report
from experiments.lib.store import atomic_write_text


def write_result(out: str, result: dict, text: str) -> None:
  """A benchmark's result dict as <out>.json and its markdown as <out>.md; the markdown is printed."""
  atomic_write_text(out + ".json", report.dumps(result))
  atomic_write_text(out + ".md", text + "\n")
  print(text)


def run_benchmark(name: str, config, runner, markdown, argv) -> None:
  """The body of the config-file benchmark launchers: flags (one device) -> the model (bench/models.py) ->
  runner(config, model, log) -> <config.out>.json and .md (markdown(result)), printed."""
  launch.start_one_device(name, argv)
  commit = exp_report.code_commit()                   # the code that runs (HEAD may move while it does)
  logging.info("config:\n%s", config)
  logging.info("devices: %s", jax.devices())
  with launch.bad_input_as_usage():
    model = models.load(config.model, config.dtype, config.seed)
    result = runner(config, model, log=logging.info)
  result["meta"]["command"] = launch.command_line(name)
  result["meta"]["commit"] = commit
  write_result(config.out, result, markdown(result))
