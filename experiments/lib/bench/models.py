"""The models a benchmark runs: a real checkpoint, or random weights with a named model's shape.

Step times do not depend on the weights' values, so `random:<shape>` stands in for a checkpoint where only
timing is measured (and where a long context is wanted beyond a real model's). `tiny-random` and every other
name go to `experiments.lib.models.load` (`sj.load_model`).
"""
from __future__ import annotations

import dataclasses

import jax

from specache_jax.arrays import DTYPES
from specache_jax.checkpoints.registry import Model
from specache_jax.errors import ConfigError
from experiments.lib import models as exp_models
from specache_jax.model.init import init_params
from specache_jax.model_config import ModelConfig

RANDOM_PREFIX = "random:"
SHAPES = {
    # SmolLM2-135M(-Instruct): the project's embedded checkpoint.
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         head_dim=64, ffn_dim=1536, norm_eps=1e-5, rope_theta=100000.0, max_position=8192,
                         tie_embeddings=True, eos_token_ids=(2,)),
    # Llama-3.2-1B: a mid-size GQA decoder for the GPU sweep.
    "llama3.2-1b": dict(architecture="llama", vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                        head_dim=64, ffn_dim=8192, norm_eps=1e-5, rope_theta=500000.0, max_position=131072,
                        tie_embeddings=True, eos_token_ids=(128009,)),
    # Llama-3-8B: the paper's scale (GPU check, memory plans).
    "llama3-8b": dict(architecture="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      head_dim=128, ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0, max_position=8192,
                      tie_embeddings=False, eos_token_ids=(128001, 128009)),
    # A few-layer toy with head_dim 16 for the benchmark's own tests (group sizes up to 16).
    "tiny": dict(architecture="llama", vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16,
                 ffn_dim=64, rope_theta=10000.0, max_position=4096, eos_token_ids=()),
}


def load(name: str, dtype: str = "", seed: int = 0) -> Model:
  """`random:<shape>` (a key of SHAPES), or anything `experiments.lib.models.load` accepts."""
  if name.startswith(RANDOM_PREFIX):
    shape = name[len(RANDOM_PREFIX):]
    if shape not in SHAPES:
      raise ConfigError(f"model={name!r}: random shape {shape!r} must be one of {sorted(SHAPES)}")
    if dtype and dtype not in DTYPES:
      raise ConfigError(f"dtype={dtype!r} must be '' or one of {sorted(DTYPES)}")
    cfg = ModelConfig(**SHAPES[shape], name=name)
    params = init_params(cfg, jax.random.key(seed), DTYPES.get(dtype or "float32"))
    return Model(cfg, params, None, f"random weights (seed {seed}) with {shape}'s shape")
  return dataclasses.replace(exp_models.load(name, dtype), source=f"checkpoint {name!r}")
