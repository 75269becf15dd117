"""Grouped asymmetric min-max quantization (KIVI) with SpeCache's 1-bit rule, and bit packing.

Axis letters (docs/design.md): B batch, K KV heads, S cached slots, H head dim, C packed bytes along H,
P quantization groups along S (keys: P = S / g).

- Keys: per channel, `g` consecutive tokens form a group -> scale/zero [B, K, S/g, H].
- Values: per token, `g` consecutive channels of one head form a group -> scale/zero [B, K, S, H/g].
- b-bit KIVI on a group with min m, max M: s = (M - m) / (2^b - 1), z = m, q = clip(round((x - z) / s)),
  x_hat = q * s + z.
- SpeCache 1-bit (`one_bit="specache"`): z = (3m + M) / 4, s = (M - m) / 2, codes clipped to {0, 1}; the
  two levels are m + (M - m)/4 and m + 3(M - m)/4. `one_bit="kivi"` keeps the plain rule (levels m, M).
- Codes are bit-packed along H: code j goes to byte j // (8/b), bits from (j % (8/b)) * b (little-endian).

Numerics: statistics and codes are computed in float32. Scale and zero are rounded to the storage dtype
first and the codes are computed against the stored values, so dequantization is consistent with what is
stored. M - m is formed as M/2 - m/2 (no overflow for finite float32 inputs); huge scales are rescaled by
an exact power of two before dividing, and a dequantized sum that overflows falls back to a halved
computation. Limits: inputs must be finite; a scale or zero that does not fit the storage dtype is clamped
to its largest finite value (only KIVI 1-bit, whose scale is M - m itself, can hit this for float32/bfloat16
storage of float32/bfloat16 inputs, when it exceeds the dtype's max); XLA flushes float32 subnormals
(|x| < 1.2e-38) to zero, so such inputs come back as 0, and a group whose scale would be subnormal (M - m below
~(2^b - 1) * 1.2e-38) collapses to its zero point (error at most M - m).

All functions are pure jnp; `bits`, `group_size`, `one_bit`, `axis`, `dtype` and `n` are static.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels import BITS

ONE_BIT_RULES = ("specache", "kivi")


def validate(bits: int, group_size: int, head_dim: int, residual: int | None = None) -> None:
  """Raises ValueError naming the value and the rule when a quantized cache layout cannot work."""
  _check_bits(bits)
  if group_size <= 0:
    raise ValueError(f"{group_size=} must be > 0")
  if head_dim % group_size:
    raise ValueError(f"{group_size=} must divide {head_dim=} (values are grouped along channels)")
  if residual is not None and residual % group_size:
    raise ValueError(f"{group_size=} must divide {residual=} (keys are quantized a whole residual "
                     "window at a time)")
  if (head_dim * bits) % 8:
    raise ValueError(f"{head_dim=} * {bits=} must be a multiple of 8 (codes are packed into bytes)")


def _check_bits(bits: int) -> None:
  if bits not in BITS:
    raise ValueError(f"{bits=} is not supported; expected one of {BITS}")


def _check_one_bit(one_bit: str) -> None:
  if one_bit not in ONE_BIT_RULES:
    raise ValueError(f"{one_bit=} is not a 1-bit rule; expected one of {ONE_BIT_RULES}")


def _shift_row(rank: int, bits: int) -> jax.Array:
  """Bit offsets [1, ..., 1, 8/b] (rank-explicit, for broadcasting against [..., n/(8/b), 8/b])."""
  per_byte = 8 // bits
  return (jnp.arange(per_byte, dtype=jnp.uint8) * bits).reshape((1,) * (rank - 1) + (per_byte,))


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """codes uint8 [..., n], each < 2**bits -> packed uint8 [..., n * bits // 8]."""
  _check_bits(bits)
  n = codes.shape[-1]
  if (n * bits) % 8:
    raise ValueError(f"last axis n={n} * {bits=} must be a multiple of 8 to pack into bytes")
  codes = codes.astype(jnp.uint8)
  if bits == 8:
    return codes
  per_byte = 8 // bits
  grouped = (codes & jnp.uint8(2**bits - 1)).reshape(codes.shape[:-1] + (n // per_byte, per_byte))
  shifted = grouped << _shift_row(grouped.ndim, bits)           # [..., C, 8/b], disjoint bit fields
  packed = shifted[..., 0]
  for j in range(1, per_byte):
    packed = packed | shifted[..., j]
  return packed                                                 # [..., C]


def unpack_bits(packed: jax.Array, bits: int, n: int) -> jax.Array:
  """packed uint8 [..., C] with C = n * bits // 8 -> codes uint8 [..., n]."""
  _check_bits(bits)
  if (n * bits) % 8 or packed.shape[-1] != n * bits // 8:
    raise ValueError(f"packed last axis {packed.shape[-1]} does not hold n={n} codes of {bits=} "
                     f"(expected n * bits / 8 = {n * bits / 8})")
  packed = packed.astype(jnp.uint8)
  if bits == 8:
    return packed
  per_byte = 8 // bits
  fields = (packed[..., None] >> _shift_row(packed.ndim + 1, bits)) & jnp.uint8(2**bits - 1)
  return fields.reshape(packed.shape[:-1] + (n,))              # [..., C, 8/b] -> [..., n]


def _finite_clamp(x: jax.Array, dtype) -> jax.Array:
  """Clamps float32 `x` into the finite range of `dtype` and casts (stored scale/zero never become inf)."""
  big = float(jnp.finfo(dtype).max)
  return jnp.clip(x, -big, big).astype(dtype)


def quantize_minmax(x: jax.Array, bits: int, axis: int, one_bit: str = "specache", dtype=None,
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Grouped quantization of `x` along `axis`: min-max, or for 1 bit the rule `one_bit` (module docstring).

  x: [...] finite floats. Returns (codes uint8 same shape as x, unpacked; scale, zero with `axis` kept
  as size 1, stored in `dtype`, default x.dtype).
  """
  _check_bits(bits)
  _check_one_bit(one_bit)
  dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"scale/zero {dtype=} must be a floating dtype")
  axis = axis % x.ndim
  xf = x.astype(jnp.float32)
  lo = jnp.min(xf, axis=axis, keepdims=True)
  hi = jnp.max(xf, axis=axis, keepdims=True)
  half_range = hi * 0.5 - lo * 0.5                              # (M - m) / 2, cannot overflow
  if bits == 1 and one_bit == "specache":
    scale = half_range                                          # (M - m) / 2
    zero = lo + half_range * 0.5                                # (3m + M) / 4, between m and M
  else:
    scale = half_range / ((2**bits - 1) * 0.5)                  # (M - m) / (2^b - 1)
    zero = lo
  scale_st = _finite_clamp(scale, dtype)
  zero_st = _finite_clamp(zero, dtype)
  s = scale_st.astype(jnp.float32)
  z = zero_st.astype(jnp.float32)
  safe_s = jnp.where(s > 0, s, jnp.ones_like(s))                 # constant group: x - z = 0 -> code 0
  # Huge scales: divide by s * 2^-32 (exact power-of-two rescaling). Keeps x - z from overflowing and the
  # divisor's reciprocal (vectorised XLA division) from becoming subnormal and being flushed to zero.
  pre = jnp.where(safe_s > 2.0**64, jnp.full_like(s, 2.0**-32), jnp.ones_like(s))
  ratio = (xf * pre - z * pre) / (safe_s * pre)
  codes = jnp.clip(jnp.round(ratio), 0, 2**bits - 1).astype(jnp.uint8)
  return codes, scale_st, zero_st


def dequantize_minmax(codes: jax.Array, scale: jax.Array, zero: jax.Array, dtype=jnp.float32) -> jax.Array:
  """x_hat = codes * scale + zero in float32, cast to `dtype`.

  codes: uint8 [...] unpacked; scale, zero: same rank as codes, broadcastable (size 1 on the group axis).
  """
  q = codes.astype(jnp.float32)
  s = scale.astype(jnp.float32)
  z = zero.astype(jnp.float32)
  plain = q * s + z
  halved = (q * (s * 0.5) + z * 0.5) * 2.0                      # only where q * s overflowed
  return jnp.where(jnp.isfinite(plain), plain, halved).astype(dtype)


@flax.struct.dataclass
class QuantizedKeys:
  """Low-bit keys, per-channel groups of g consecutive tokens (P = S / g)."""
  codes: jax.Array   # uint8 [B, K, S, C], C = H * b / 8
  scale: jax.Array   # [B, K, P, H]
  zero: jax.Array    # [B, K, P, H]


@flax.struct.dataclass
class QuantizedValues:
  """Low-bit values, per-token groups of g consecutive channels of one head."""
  codes: jax.Array   # uint8 [B, K, S, C], C = H * b / 8
  scale: jax.Array   # [B, K, S, H / g]
  zero: jax.Array    # [B, K, S, H / g]


def quantize_keys(k: jax.Array, bits: int, group_size: int, one_bit: str = "specache",
                  dtype=None) -> QuantizedKeys:
  """k: [B, K, S, H] with S % group_size == 0 -> QuantizedKeys (scale/zero in `dtype`, default k.dtype)."""
  b, kh, s, h = k.shape
  _check_bits(bits)
  if group_size <= 0 or s % group_size:
    raise ValueError(f"{group_size=} must be > 0 and divide the key length S={s} (keys are grouped "
                     "along tokens)")
  if (h * bits) % 8:
    raise ValueError(f"head_dim={h} * {bits=} must be a multiple of 8 (codes are packed into bytes)")
  k_bkpgh = k.reshape(b, kh, s // group_size, group_size, h)
  codes, scale, zero = quantize_minmax(k_bkpgh, bits, axis=3, one_bit=one_bit, dtype=dtype)
  return QuantizedKeys(codes=pack_bits(codes.reshape(b, kh, s, h), bits),   # [B, K, S, C]
                       scale=scale[:, :, :, 0, :],                          # [B, K, P, H]
                       zero=zero[:, :, :, 0, :])


def dequantize_keys(qk: QuantizedKeys, bits: int, group_size: int, dtype=jnp.float32) -> jax.Array:
  """QuantizedKeys -> keys [B, K, S, H] in `dtype`."""
  b, kh, s, c = qk.codes.shape
  p, h = qk.scale.shape[2], qk.scale.shape[3]
  if group_size <= 0 or p * group_size != s:
    raise ValueError(f"{group_size=} does not match codes S={s} and scale P={p} (need S = P * g)")
  codes_bkpgh = unpack_bits(qk.codes, bits, h).reshape(b, kh, p, group_size, h)
  x = dequantize_minmax(codes_bkpgh, qk.scale[:, :, :, None, :], qk.zero[:, :, :, None, :], dtype)
  return x.reshape(b, kh, s, h)


def quantize_values(v: jax.Array, bits: int, group_size: int, one_bit: str = "specache",
                    dtype=None) -> QuantizedValues:
  """v: [B, K, S, H] with H % group_size == 0 -> QuantizedValues (scale/zero in `dtype`, default v.dtype)."""
  b, kh, s, h = v.shape
  validate(bits, group_size, h)
  v_bksph = v.reshape(b, kh, s, h // group_size, group_size)    # groups of g channels: [B, K, S, H/g, g]
  codes, scale, zero = quantize_minmax(v_bksph, bits, axis=4, one_bit=one_bit, dtype=dtype)
  return QuantizedValues(codes=pack_bits(codes.reshape(b, kh, s, h), bits),  # [B, K, S, C]
                         scale=scale[..., 0],                                # [B, K, S, H/g]
                         zero=zero[..., 0])


def dequantize_values(qv: QuantizedValues, bits: int, group_size: int, dtype=jnp.float32) -> jax.Array:
  """QuantizedValues -> values [B, K, S, H] in `dtype`."""
  b, kh, s, c = qv.codes.shape
  n_groups = qv.scale.shape[3]
  h = n_groups * group_size
  if group_size <= 0 or c * 8 != h * bits:
    raise ValueError(f"{group_size=} and {bits=} do not match codes C={c} and scale H/g={n_groups} "
                     "(need C * 8 = H * b with H = (H/g) * g)")
  codes_bksph = unpack_bits(qv.codes, bits, h).reshape(b, kh, s, n_groups, group_size)
  x = dequantize_minmax(codes_bksph, qv.scale[..., None], qv.zero[..., None], dtype)
  return x.reshape(b, kh, s, h)


def bits_per_element(bits: int, group_size: int, scale_bytes: int = 2) -> float:
  """Average stored bits per quantized element: b codes + a scale and a zero per group of g."""
  _check_bits(bits)
  if group_size <= 0:
    raise ValueError(f"{group_size=} must be > 0")
  return bits + 2 * 8 * scale_bytes / group_size
