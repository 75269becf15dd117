"""Helpers shared by the low-bit kernels: validation, in-kernel unpacking and dequantization, dots.

Axis letters (docs/design.md): B batch, T query rows, S cached slots, N query heads, K KV heads, G query heads
per KV head, H head dim, C packed bytes along H (C = H·b/8), P key groups along S. Inside a kernel, R is the
query rows of one KV head (g-major: row r = g·T + t, padded with zero rows to a power of two ≥ 16).

Packing (docs/design.md): code j of a row sits in byte j // (8/b) at bit offset (j % (8/b))·b.
Dequantization: x̂ = code·scale + zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import BITS

MIN_DOT_DIM = 16  # Triton's tl.dot needs every operand dimension >= 16.


def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def padded_heads(g: int, t: int) -> int:
  """Query heads per KV head padded so that Gp is a power of two and Gp·T >= 16 (a Triton dot operand)."""
  return max(next_pow2(g), next_pow2(-(-MIN_DOT_DIM // t)))


def check_block_s(block_s: int, name: str) -> None:
  if not is_pow2(block_s) or block_s < MIN_DOT_DIM:
    raise ValueError(f"{name}.{block_s=} must be a power of two >= {MIN_DOT_DIM} (Triton block shapes)")


def check_warps(num_warps: int, num_stages: int, name: str) -> None:
  if not is_pow2(num_warps):
    raise ValueError(f"{name}.{num_warps=} must be a power of two")
  if num_stages < 1:
    raise ValueError(f"{name}.{num_stages=} must be >= 1")


def check_quant_layout(bits: int, group_size: int, head_dim: int, block_s: int) -> None:
  """The rules every low-bit kernel shares; each error names the value and the rule."""
  if bits not in BITS:
    raise ValueError(f"{bits=} is not supported; expected one of {BITS}")
  if not is_pow2(group_size):
    raise ValueError(f"{group_size=} must be a power of two (Triton block shapes)")
  if not is_pow2(head_dim) or head_dim < MIN_DOT_DIM:
    raise ValueError(f"{head_dim=} must be a power of two >= {MIN_DOT_DIM} (Triton block shapes)")
  if block_s % group_size:
    raise ValueError(f"{group_size=} must divide {block_s=} (a block holds whole key groups)")


def check_key_arrays(k_codes, k_scale, k_zero, bits: int, group_size: int, head_dim: int) -> None:
  b, kh, s, c = k_codes.shape
  if k_codes.dtype != jnp.uint8:
    raise ValueError(f"k_codes.dtype={k_codes.dtype} must be uint8")
  if c * 8 != head_dim * bits:
    raise ValueError(f"k_codes packed bytes C={c} must equal {head_dim=} * {bits=} / 8")
  p_needed = -(-s // group_size)
  for name, x in (("k_scale", k_scale), ("k_zero", k_zero)):
    if x.ndim != 4 or x.shape[:2] != (b, kh) or x.shape[3] != head_dim or x.shape[2] < p_needed:
      raise ValueError(f"{name}.shape={x.shape} must be [B={b}, K={kh}, P>={p_needed}, H={head_dim}] "
                       f"(S={s}, {group_size=})")


def triton_params(num_warps: int, num_stages: int):
  """Compiler params selecting the Triton GPU backend (see the module docstrings for why)."""
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------------------------------
# In-kernel pieces (operate on loaded values; only ops the Triton lowering supports: no value slicing).

def unpack_block(codes: jax.Array, bits: int, head_dim: int) -> jax.Array:
  """codes uint8 [S', C] -> int32 [S', H]; upcast first (8-bit pointwise ops do not lower on GPU)."""
  per_byte = 8 // bits
  codes32 = codes.astype(jnp.int32)
  shifts = lax.broadcasted_iota(jnp.int32, (1, 1, per_byte), 2) * bits        # [1, 1, 8/b]
  fields = (codes32[:, :, None] >> shifts) & ((1 << bits) - 1)                  # [S', C, 8/b]
  return fields.reshape(codes.shape[0], head_dim)


def dequant_keys_block(codes_int: jax.Array, scale: jax.Array, zero: jax.Array,
                       group_size: int) -> jax.Array:
  """codes_int [S', H] (S' = P'·g), scale/zero [P', H] (per-channel groups of g slots) -> f32 [S', H]."""
  s, h = codes_int.shape
  p = s // group_size
  codes_pgh = codes_int.astype(jnp.float32).reshape(p, group_size, h)
  k_pgh = (codes_pgh * scale.astype(jnp.float32)[:, None, :]
           + zero.astype(jnp.float32)[:, None, :])
  return k_pgh.reshape(s, h)


def dequant_values_block(codes_int: jax.Array, scale: jax.Array, zero: jax.Array,
                         group_size: int) -> jax.Array:
  """codes_int [S', H], scale/zero [S', H/g] (per-token groups of g channels) -> f32 [S', H]."""
  s, h = codes_int.shape
  codes_sqg = codes_int.astype(jnp.float32).reshape(s, h // group_size, group_size)
  v_sqg = (codes_sqg * scale.astype(jnp.float32)[:, :, None]
           + zero.astype(jnp.float32)[:, :, None])
  return v_sqg.reshape(s, h)


def dot_nt(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  """a [M, D] · b [N, D]ᵀ -> f32 [M, N]; operands in `dtype` (f32: full precision, no TF32)."""
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return plgpu.dot(a.astype(dtype), b.astype(dtype), trans_b=True, precision=precision)


def dot_nn(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  """a [M, D] · b [D, N] -> f32 [M, N]; operands in `dtype` (f32: full precision, no TF32)."""
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return plgpu.dot(a.astype(dtype), b.astype(dtype), precision=precision)


# ----------------------------------------------------------------------------------------------------
# References (plain jnp, float32; independent of specache_jax.quant beyond the documented layout).

def unpack_reference(packed: jax.Array, bits: int, n: int) -> jax.Array:
  """packed uint8 [..., C] -> int32 codes [..., n] (code j: byte j // (8/b), bits (j % (8/b))·b)."""
  per_byte = 8 // bits
  j = jnp.arange(n)
  byte = jnp.take(packed.astype(jnp.int32), j // per_byte, axis=-1)            # [..., n]
  shift = ((j % per_byte) * bits).reshape((1,) * (packed.ndim - 1) + (n,))
  return (byte >> shift) & ((1 << bits) - 1)


def dequant_keys_reference(codes, scale, zero, bits: int, group_size: int) -> jax.Array:
  """codes [B, K, S, C], scale/zero [B, K, P, H] -> f32 keys [B, K, S, H]."""
  h = scale.shape[-1]
  s = codes.shape[2]
  group = jnp.arange(s) // group_size                                           # [S]
  scale_s = jnp.take(scale.astype(jnp.float32), group, axis=2)                  # [B, K, S, H]
  zero_s = jnp.take(zero.astype(jnp.float32), group, axis=2)
  return unpack_reference(codes, bits, h).astype(jnp.float32) * scale_s + zero_s


def dequant_values_reference(codes, scale, zero, bits: int, group_size: int) -> jax.Array:
  """codes [B, K, S, C], scale/zero [B, K, S, H/g] -> f32 values [B, K, S, H]."""
  h = scale.shape[-1] * group_size
  chan_group = jnp.arange(h) // group_size                                      # [H]
  scale_h = jnp.take(scale.astype(jnp.float32), chan_group, axis=3)             # [B, K, S, H]
  zero_h = jnp.take(zero.astype(jnp.float32), chan_group, axis=3)
  return unpack_reference(codes, bits, h).astype(jnp.float32) * scale_h + zero_h
