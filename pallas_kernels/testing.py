"""Seeded inputs for the kernel tests and the kernel benchmark: a low-bit cache poisoned past its length.

Codes are uniform random bytes (every byte is a valid packing of 8/b codes of b bits), scales uniform in
[0.05, 0.5), zeros standard normal: dequantized values of the size real keys/values have. Built with numpy
(no compilation per shape, which keeps the interpret-mode tests fast); the layout is docs/design.md's.

With `poison=True` every slot s >= lengths[b] is unusable: its codes are random, its value scale/zero are
NaN, and key groups that start at or after the length have NaN scale/zero. A kernel that reads past the
valid length then produces NaN (or wrong numbers) and fails its comparison.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def low_bit_cache(rng: np.random.Generator, *, batch: int, kv_heads: int, slots: int, head_dim: int,
                  bits: int, group_size: int, lengths, dtype=jnp.float32, poison: bool = True) -> dict:
  """k_codes, v_codes uint8 [B, K, S, C]; k_scale/k_zero [B, K, P, H] (P = ceil(S/g));
  v_scale/v_zero [B, K, S, H/g]; scales and zeros in `dtype`. lengths: ints [B]."""
  n_bytes = head_dim * bits // 8
  n_groups = -(-slots // group_size)
  codes_shape = (batch, kv_heads, slots, n_bytes)
  key_shape = (batch, kv_heads, n_groups, head_dim)
  value_shape = (batch, kv_heads, slots, head_dim // group_size)
  cache = dict(
      k_codes=rng.integers(0, 256, codes_shape, dtype=np.uint8),
      k_scale=rng.uniform(0.05, 0.5, key_shape).astype(np.float32),
      k_zero=rng.standard_normal(key_shape).astype(np.float32),
      v_codes=rng.integers(0, 256, codes_shape, dtype=np.uint8),
      v_scale=rng.uniform(0.05, 0.5, value_shape).astype(np.float32),
      v_zero=rng.standard_normal(value_shape).astype(np.float32))
  if poison:
    lengths = np.asarray(lengths)
    slot_dead = (np.arange(slots)[None, :] >= lengths[:, None])[:, None, :, None]             # [B,1,S,1]
    group_dead = (np.arange(n_groups)[None, :] * group_size >= lengths[:, None])[:, None, :, None]
    for name in ("k_scale", "k_zero"):
      cache[name] = np.where(group_dead, np.nan, cache[name])
    for name in ("v_scale", "v_zero"):
      cache[name] = np.where(slot_dead, np.nan, cache[name])
  return {name: jnp.asarray(x, jnp.uint8 if x.dtype == np.uint8 else dtype) for name, x in cache.items()}


def quant_scores_inputs(seed: int, *, batch: int, t: int, kv_heads: int, gqa: int, slots: int,
                        head_dim: int, bits: int, group_size: int, lengths, dtype=jnp.float32,
                        poison: bool = True) -> tuple:
  """(q [B, T, K, G, H], k_codes, k_scale, k_zero, lengths int32 [B]) for `quant_scores`."""
  rng = np.random.default_rng(seed)
  cache = low_bit_cache(rng, batch=batch, kv_heads=kv_heads, slots=slots, head_dim=head_dim, bits=bits,
                        group_size=group_size, lengths=lengths, dtype=dtype, poison=poison)
  q = jnp.asarray(rng.standard_normal((batch, t, kv_heads, gqa, head_dim)), dtype)
  return q, cache["k_codes"], cache["k_scale"], cache["k_zero"], jnp.asarray(lengths, jnp.int32)


def mixed_inputs(seed: int, *, batch: int, t: int, kv_heads: int, gqa: int, slots: int, head_dim: int,
                 bits: int, group_size: int, lengths, n_exclude: int, n_extra: int, dtype=jnp.float32,
                 mask_p: float = 0.6, poison: bool = True) -> tuple:
  """The 12 positional arguments of `mixed_decode_attention`.

  exclude [B, K, X]: random slots in [-1, max(lengths)) (duplicates and -1 = none included);
  extra_mask [B, K, T, E]: Bernoulli(mask_p); extra rows that no query row reads are NaN when poisoned.
  """
  rng = np.random.default_rng(seed)
  cache = low_bit_cache(rng, batch=batch, kv_heads=kv_heads, slots=slots, head_dim=head_dim, bits=bits,
                        group_size=group_size, lengths=lengths, dtype=dtype, poison=poison)
  q = rng.standard_normal((batch, t, kv_heads * gqa, head_dim))
  exclude = rng.integers(-1, max(max(lengths), 1), (batch, kv_heads, n_exclude))
  extra_k = rng.standard_normal((batch, kv_heads, n_extra, head_dim))
  extra_v = rng.standard_normal((batch, kv_heads, n_extra, head_dim))
  extra_mask = rng.random((batch, kv_heads, t, n_extra)) < mask_p
  if poison:
    unused = ~extra_mask.any(axis=2)[..., None]                                              # [B,K,E,1]
    extra_k = np.where(unused, np.nan, extra_k)
    extra_v = np.where(unused, np.nan, extra_v)
  return (jnp.asarray(q, dtype), cache["k_codes"], cache["k_scale"], cache["k_zero"], cache["v_codes"],
          cache["v_scale"], cache["v_zero"], jnp.asarray(lengths, jnp.int32),
          jnp.asarray(exclude, jnp.int32), jnp.asarray(extra_k, dtype), jnp.asarray(extra_v, dtype),
          jnp.asarray(extra_mask))
