"""Checkpoint loading: HF safetensors directories, GGUF files, orbax directories, and the registered names.

Every loader returns params in the layout of docs/design.md (stacked [L, ...] leaves, weights [in, out], Q/K rows in
HF's rotate-half RoPE layout). `load_model` (registry.py) picks the loader and caches converted weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax.arrays import DTYPES


class CheckpointError(ValueError):
  """A checkpoint that cannot be loaded: the message names the file or tensor and what was expected."""


def resolve_dtype(dtype) -> np.dtype:
  """A jnp/np dtype or its name -> a numpy dtype among float32, bfloat16, float16 (else CheckpointError)."""
  try:
    resolved = np.dtype(jnp.dtype(dtype))
  except TypeError as err:
    raise CheckpointError(f"dtype={dtype!r} is not a dtype; expected one of {tuple(DTYPES)}") from err
  if resolved.name not in DTYPES:
    raise CheckpointError(f"dtype={resolved.name!r} is not supported for weights; expected one of {tuple(DTYPES)}")
  return resolved


def to_jax(params_np: dict, dtype) -> dict:
  """numpy params (any float dtype) -> jax arrays of `dtype` (norms included: the decoder casts as needed)."""
  target = resolve_dtype(dtype)
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x, dtype=target)), params_np)

