"""What every cache method shares: the config base class, the per-row lengths wrapper, the name registry.

A method lives in one file (`full.py`, `kivi.py`, `specache.py`, `streaming.py`, `h2o.py`) with a frozen config
dataclass subclassing `CacheConfig` and module-level pure functions
  init(cfg, model_cfg, batch, max_len, dtype) -> State          (leaves [L, ...])
  prefill(cfg, st, k[B,T,K,H], v[B,T,K,H], lengths[B], colsum[B,K,T] | None) -> st   (per-layer st)
  attend(cfg, st, q[B,T,N,H], k_new[B,T,K,H], v_new[B,T,K,H], lengths[B]) -> (out[B,T,N,H], st, aux)
  device_bytes(cfg, st) -> int
The decoder reaches them through `cfg.impl` (the module), never by comparing names.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax.errors import ConfigError
from specache_jax.model.config import ModelConfig


class CacheConfig:
  """Base of every method's frozen config dataclass."""
  name: ClassVar[str] = ""
  # Query rows per decoding step (SpeCache: 2 = real + speculative) and rows stored of them.
  decode_width: ClassVar[int] = 1
  needs_attention_colsum: ClassVar[bool] = False
  uses_predecode: ClassVar[bool] = False

  @property
  def impl(self) -> types.ModuleType:
    raise NotImplementedError

  def validate(self, model_cfg: ModelConfig, max_len: int) -> None:
    """Raise ConfigError naming the value and the rule; called before anything is compiled."""

  def rows_stored(self, t: int, phase: str) -> int:
    """How many of the T new rows of a call enter the cache (all, except SpeCache's speculative row)."""
    return t

  def slots(self, max_len: int) -> int:
    """The slot count S to allocate for `max_len` tokens (methods round up to their group sizes)."""
    return max_len


@struct.dataclass
class Cache:
  layers: Any                 # the method's State, leaves [L, ...]
  lengths: jax.Array          # [B] int32 tokens stored per row


def settings_of(cfg) -> dict[str, Any]:
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def check_int(name: str, value, minimum: int = 0) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


def stack_layers(n_layers: int, tree):
  """Give every leaf of a per-layer state a leading L axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n_layers,) + x.shape), tree)


def tree_nbytes(tree) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
