"""Generate a completion for one prompt and print it.

  python -m experiments.generate --config=configs/generate.py --config.prompt="..." [--config.cache=specache]
"""
from absl import app, logging
from ml_collections import config_flags

from specache_jax.experiments_lib import generate, launch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/generate.py", "generation config", lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  mesh = launch.setup()
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  try:
    result = generate.run(config, mesh=mesh)
  except (generate.SettingsError, *launch.user_errors()) as e:   # bad input: a usage message, no traceback
    raise app.UsageError(f"{type(e).__name__}: {e}") from None
  print(result.text)
  logging.info("%d prompt tokens, %d new tokens, %.1f s (incl. compilation)", result.prompt_tokens,
               result.new_tokens, result.seconds)
  if result.stats is not None:
    print({k: (round(v, 4) if isinstance(v, float) else [round(x, 4) for x in v]) for k, v in result.stats.items()})


if __name__ == "__main__":
  app.run(main)
