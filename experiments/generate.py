"""Generate a completion for one prompt and print it.

  python -m experiments.generate --config=configs/generate.py --config.prompt="..." [--config.cache=specache]
"""
from absl import app, logging
from ml_collections import config_flags

from experiments.lib import generate, launch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/generate.py", "generation config", lock_config=True)


def main(argv):
  mesh = launch.start(argv)
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  with launch.bad_input_as_usage(generate.SettingsError):
    result = generate.run(config, mesh=mesh)
  print(result.text)
  logging.info("%d prompt tokens, %d new tokens, %.1f s (incl. compilation)", result.prompt_tokens,
               result.new_tokens, result.seconds)
  if result.stats is not None:
    print({k: (round(v, 4) if isinstance(v, (int, float)) else [round(x, 4) for x in v]) for k, v in result.stats.items()})


if __name__ == "__main__":
  app.run(main)
