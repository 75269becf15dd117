"""The low-bit cache's ring as key columns (`caches/lowbit.py`'s `ring_segment`) on XLA:CPU (`ring_keys.cc`),
beside its jnp reference.

Ring slot s of a sequence with n stored positions holds position key_qlen + s where s < n - key_qlen (key_qlen =
⌊n/R⌋·R; a 16-bit key, the ring's own row) and key_qlen - R + s otherwise (a quantized key: row s of the last
flushed window, dequantized). The reference slices the window's codes and key groups and selects in jnp; XLA:CPU
fuses that into one loop that recomputes the slices' offsets and bit fields per element (~21 µs per layer at
batch 1, ~55 µs at batch 4 for SmolLM2's R = H = 64), the kernel copies or dequantizes each slot's row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specache_jax import cpu_kernels as ck
from specache_jax import quant


def _check(ring_k, k_codes, k_scale, k_zero, lengths, bits: int, group_size: int) -> None:
  ok = (ring_k.ndim == 4 and k_codes.ndim == 4 and k_scale.ndim == 4 and k_zero.shape == k_scale.shape
        and lengths.ndim == 1 and k_codes.shape[:2] == ring_k.shape[:2] == k_scale.shape[:2]
        and lengths.shape[0] == ring_k.shape[0] and k_scale.shape[3] == ring_k.shape[3])
  if not ok:
    raise ValueError(f"ring_keys: ring_k [B, K, R, H], k_codes [B, K, S, C], k_scale / k_zero [B, K, P, H], lengths "
                     f"[B]; got {ring_k.shape}, {k_codes.shape}, {k_scale.shape} / {k_zero.shape}, {lengths.shape}")
  r, h, s = ring_k.shape[2], ring_k.shape[3], k_codes.shape[2]
  if k_codes.shape[3] * 8 != h * bits or r % group_size or s < r or k_scale.shape[2] * group_size < s:
    raise ValueError(f"ring_keys: {bits=}, {group_size=}: need C = H·bits/8 (C={k_codes.shape[3]}, H={h}), R={r} a "
                     f"multiple of group_size, S={s} >= R and P·group_size >= S (P={k_scale.shape[2]})")


def ring_keys_reference(ring_k, k_codes, k_scale, k_zero, lengths, *, bits: int, group_size: int,
                        dtype=jnp.float32):
  """[B, K, R, H] in `dtype`: the ring's key columns (the module docstring). Contiguous slices of the window's
  codes and R/g key groups (no gather); the dequantized rows are garbage where key_qlen = 0 (no window yet: those
  slots hold no position)."""
  _check(ring_k, k_codes, k_scale, k_zero, lengths, bits, group_size)
  n_kv, r, h = ring_k.shape[1], ring_k.shape[2], ring_k.shape[3]
  key_qlen = (lengths // r) * r
  start = jnp.maximum(key_qlen - r, 0)
  take = lambda buf, at, n: jnp.concatenate([jax.lax.dynamic_slice(                 # noqa: E731
      buf, (i, 0, at[i], 0), (1, n_kv, n, buf.shape[-1])) for i in range(buf.shape[0])], axis=0)
  codes = take(k_codes, start, r)
  scale, zero = (jnp.repeat(take(x, start // group_size, r // group_size), group_size, axis=2)
                 for x in (k_scale, k_zero))
  low = quant.dequantize_minmax(quant.unpack_bits(codes, bits, h), scale, zero, dtype)
  sixteen = jnp.arange(r, dtype=jnp.int32)[None, None, :, None] < (lengths - key_qlen)[:, None, None, None]
  return jnp.where(sixteen, ring_k.astype(dtype), low)


def applies(ring_k, k_scale, dtype) -> bool:
  """Whether `ring_keys` may take the kernel: float32 ring, key groups and result, and the kernels built."""
  return ring_k.dtype == k_scale.dtype == jnp.dtype(dtype) == jnp.float32 and ck.available()


def ring_keys(ring_k, k_codes, k_scale, k_zero, lengths, *, bits: int, group_size: int, dtype=jnp.float32):
  """`ring_keys_reference` (the same signature) by the kernel (float32: where it `applies`). CPU backend only;
  `specache_jax.dispatch.ring_keys` chooses between the two."""
  del dtype
  _check(ring_k, k_codes, k_scale, k_zero, lengths, bits, group_size)
  if not ck.available():
    raise RuntimeError(f"ring_keys: CPU kernels {ck.status()}")
  return _batch_partitioned(bits, group_size)(ring_k, k_codes, k_scale, k_zero, lengths.astype(jnp.int32))


def _call(bits: int, group_size: int, ring_k, *rest):
  out = jax.ShapeDtypeStruct(ring_k.shape, jnp.float32)
  return jax.ffi.ffi_call(ck.RING_KEYS_TARGET, out, vmap_method="sequential")(ring_k, *rest, bits=bits,
                                                                              group_size=group_size)


@functools.cache
def _batch_partitioned(bits: int, group_size: int):
  rule = "b k r h, b k s c, b k p h, b k p h, b -> b k r h"
  return ck.batch_partitioned(functools.partial(_call, bits, group_size), rule, 1, ("k", "r", "h", "s", "c", "p"))
