"""Tiny random models shared by the tests."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax.model.init import init_params
from specache_jax.model_config import ModelConfig


@dataclasses.dataclass
class TinyModel:
  config: ModelConfig
  params: dict
  tokenizer: object = None


def tiny_config(**overrides) -> ModelConfig:
  base = dict(architecture="llama", vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8,
              ffn_dim=64, rope_theta=10000.0, max_position=2048, eos_token_ids=())
  base.update(overrides)
  return ModelConfig(**base)


def tiny_model(seed: int = 0, dtype=jnp.float32, scale: float = 0.3, **overrides) -> TinyModel:
  cfg = tiny_config(**overrides)
  return TinyModel(cfg, init_params(cfg, jax.random.key(seed), dtype, scale=scale))


def random_prompts(seed: int, lengths, vocab: int):
  rs = np.random.RandomState(seed)
  return [rs.randint(0, vocab, size=n).tolist() for n in lengths]
