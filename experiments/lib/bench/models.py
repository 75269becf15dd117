"""The models a benchmark runs: a real checkpoint, or random weights with a named model's shape.

Step times do not depend on the weights' values, so `random:<shape>` stands in for a checkpoint where only
timing is measured (and where a long context is wanted beyond a real model's). `tiny-random` and every other
name go to `experiments.lib.models.load` (`sj.load_model`).
"""
from __future__ import annotations

import dataclasses

import jax

from experiments.lib import models as exp_models
from specache_jax.arrays import DTYPES
from specache_jax.checkpoints.registry import Model
from specache_jax.errors import ConfigError
from specache_jax.model.init import init_params
from specache_jax.model_config import ModelConfig

RANDOM_PREFIX = "random:"


def load(name: str, dtype: str = "", seed: int = 0) -> Model:
  """`random:<shape>` (a key of `experiments.lib.models.SHAPES`), or anything `experiments.lib.models.load`
  accepts."""
  if name.startswith(RANDOM_PREFIX):
    shape = name[len(RANDOM_PREFIX):]
    if shape not in exp_models.SHAPES:
      raise ConfigError(f"model={name!r}: random shape {shape!r} must be one of {sorted(exp_models.SHAPES)}")
    if dtype and dtype not in DTYPES:
      raise ConfigError(f"dtype={dtype!r} must be '' or one of {sorted(DTYPES)}")
    cfg = ModelConfig(**exp_models.SHAPES[shape], name=name)
    params = init_params(cfg, jax.random.key(seed), DTYPES.get(dtype or "float32"))
    return Model(cfg, params, None, f"random weights (seed {seed}) with {shape}'s shape")
  return dataclasses.replace(exp_models.load(name, dtype), source=f"checkpoint {name!r}")
