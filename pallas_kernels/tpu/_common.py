"""In-kernel pieces and layout rules shared by the Mosaic TPU kernels.

Axis letters as in `pallas_kernels/_common.py`. Mosaic works on 2-D vregs of (8 sublanes, 128 lanes): every
in-kernel value here is 2-D, block shapes keep their last two dims multiples of (8, 128) or the array's own, and
the unpacking avoids lane reshapes and gathers:
- bytes to channels: channel j of a row reads byte j // (8/b), a lane gather done as a one-hot matmul on the MXU
  (bytes 0..255 and the 0/1 matrix are exact in bfloat16, the f32 accumulation sums one term), then a per-lane
  shift and mask in int32;
- key scales per group of g slots to slots, and value scales per group of g channels to channels: a select
  over the block's few groups, each group's row (column) taken by a masked sum over sublanes (lanes): exact, no
  reshape and no unaligned slice.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import BITS

LANES = 128
SUBLANES = 8


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def check_block_s(block_s: int, name: str) -> None:
  if block_s < LANES or block_s % LANES:
    raise ValueError(f"{name}.{block_s=} must be a positive multiple of {LANES} (TPU lanes)")


def check_quant_layout(bits: int, group_size: int, head_dim: int, block_s: int) -> None:
  """The layout rules of the TPU kernels; each error names the value and the rule."""
  if bits not in BITS:
    raise ValueError(f"{bits=} is not supported; expected one of {BITS}")
  if group_size < 1 or block_s % group_size:
    raise ValueError(f"{group_size=} must divide {block_s=} (a block holds whole key groups)")
  if (block_s // group_size) % SUBLANES:
    raise ValueError(f"{block_s=} must hold a multiple of {SUBLANES} key groups of {group_size=} (the key scale "
                     f"block's rows are TPU sublanes): block_s // group_size = {block_s // group_size}")
  if head_dim * bits % 8:
    raise ValueError(f"{head_dim=} * {bits=} must be a whole number of bytes")


def unpack(codes: jax.Array, bits: int, head_dim: int) -> jax.Array:
  """codes uint8 [S', C] -> int32 [S', H] (code j: byte j // (8/b), bits (j % (8/b))·b)."""
  n_bytes = codes.shape[1]
  per_byte = 8 // bits
  log_per_byte = per_byte.bit_length() - 1
  byte_of = lax.broadcasted_iota(jnp.int32, (n_bytes, head_dim), 0)
  lane = lax.broadcasted_iota(jnp.int32, (n_bytes, head_dim), 1)
  spread_CH = jnp.where(lax.shift_right_logical(lane, log_per_byte) == byte_of, 1.0, 0.0).astype(jnp.bfloat16)
  bytes_f = codes.astype(jnp.int32).astype(jnp.float32).astype(jnp.bfloat16)         # [S', C], exact
  bytes_SH = lax.dot_general(bytes_f, spread_CH, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32).astype(jnp.int32)  # [S', H]
  shift = (lax.broadcasted_iota(jnp.int32, (1, head_dim), 1) & (per_byte - 1)) * bits
  return lax.shift_right_logical(bytes_SH, shift) & ((1 << bits) - 1)


def expand_key_groups(x: jax.Array, group_size: int) -> jax.Array:
  """x [P', H] per group of g slots -> f32 [P'·g, H] (row s holds x[s // g])."""
  n_groups, head_dim = x.shape
  x = x.astype(jnp.float32)
  group = lax.div(lax.broadcasted_iota(jnp.int32, (n_groups * group_size, 1), 0), group_size)
  row = lax.broadcasted_iota(jnp.int32, (n_groups, 1), 0)
  out = jnp.zeros((n_groups * group_size, head_dim), jnp.float32)
  for p in range(n_groups):
    x_p = jnp.sum(jnp.where(row == p, x, 0.0), axis=0, keepdims=True)                 # [1, H] = x[p]
    out = jnp.where(group == p, x_p, out)
  return out


def expand_value_groups(x: jax.Array, group_size: int, head_dim: int) -> jax.Array:
  """x [S', H/g] per group of g channels -> f32 [S', H] (lane h holds x[:, h // g])."""
  rows, n_groups = x.shape
  x = x.astype(jnp.float32)
  group = lax.div(lax.broadcasted_iota(jnp.int32, (1, head_dim), 1), group_size)
  col = lax.broadcasted_iota(jnp.int32, (1, n_groups), 1)
  out = jnp.zeros((rows, head_dim), jnp.float32)
  for p in range(n_groups):
    x_p = jnp.sum(jnp.where(col == p, x, 0.0), axis=1, keepdims=True)                 # [S', 1] = x[:, p]
    out = jnp.where(group == p, x_p, out)
  return out


def dot_nt(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  """a [M, D] · b [N, D]ᵀ -> f32 [M, N]; operands in `dtype` (f32: full precision)."""
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  """a [M, D] · b [D, N] -> f32 [M, N]; operands in `dtype` (f32: full precision)."""
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def dot_dtype(dtype):
  """The MXU operand type for queries of `dtype`: bf16 stays bf16 (f16 too: the TPU computes it as f32)."""
  return jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32


def interpret_params(interpret):
  """The `interpret=` of a TPU kernel -> pallas_call's: False (compile with Mosaic), True (TPU interpret mode with
  its defaults: uninitialised memory NaN, out-of-bounds reads raise) or a `pltpu.InterpretParams`."""
  if interpret is True:
    return pltpu.InterpretParams()
  if interpret is False or isinstance(interpret, pltpu.InterpretParams):
    return interpret
  raise ValueError(f"interpret={interpret!r} must be a bool or a pltpu.InterpretParams")


def clamped_block(length, block_s: int, j):
  """The S-block that step j reads: j, or the last block holding a valid slot (so the blocks past the length
  repeat the previous index and are not fetched again)."""
  last = jnp.maximum(lax.div(length + block_s - 1, block_s) - 1, 0)
  return jnp.minimum(j, last)
