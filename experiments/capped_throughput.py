"""Decode throughput under a device-memory cap: max batch per method and context, tokens/s there and below.

  python -m experiments.capped_throughput --config=configs/capped_throughput.py      # see the config for variants
"""
from absl import app, logging
from ml_collections import config_flags

from experiments.lib import launch, report
from experiments.lib.bench import capped_report, capped_throughput
from experiments.lib.bench import models

_CONFIG = config_flags.DEFINE_config_file("config", "configs/capped_throughput.py", "experiment config",
                                          lock_config=True)


def main(argv):
  launch.start_one_device("capped_throughput", argv)
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  commit = report.code_commit()                       # the code that runs (HEAD may move while it does)
  with launch.bad_input_as_usage():
    model = None if config.plan_only else models.load(config.model, config.dtype, config.seed)
    result = capped_throughput.run(config, model, log=logging.info)
  result["meta"]["command"] = launch.command_line("capped_throughput")
  result["meta"]["commit"] = commit
  print(capped_report.write(config.out, result))


if __name__ == "__main__":
  app.run(main)
