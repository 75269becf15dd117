"""Scores of the query rows of every query head against bit-packed low-bit keys (GQA-aware).

logits[b, k, g, t, s] = sm_scale · q[b, t, k, g, :] · k̂[b, k, s, :], with
k̂[s, h] = code[s, h] · scale[s // g, h] + zero[s // g, h], and -inf for s >= lengths[b].

GPU backend: Triton (`jax.experimental.pallas.triton.CompilerParams`). Mosaic GPU, Pallas' default on
Hopper, rejects pointwise ops on 8-bit types and wants 128-multiple shapes and warpgroup-sized copies;
unpacking 1/2/4-bit codes needs shifts and masks on bytes, and decode tiles are small (T·G query rows,
H = 64, a few bytes of scales per row). This kernel without Triton params fails to lower for CUDA in jax
0.10.2 ("Only copies transferring a number of bytes divisible by the warpgroup size are supported"). The
Triton lowering takes the int32-upcast unpacking, masked loads for ragged lengths and small power-of-two
tiles, and `tests/test_kernels_lowering.py` checks that both kernels lower through it. Triton needs
power-of-two tiles: H, group_size and block_s must be powers of two (validated), T is padded with zero query
rows to a power of two (T = 3: 4; the extra rows' scores are dropped), and the G·T query rows of a KV head are
padded with zero rows to a power of two >= 16 (a tl.dot operand) before the call.

Grid (B, K, cdiv(S, block_s)): one program scores all G·T query rows of KV head k against one block of
packed keys, so the codes are read once per KV head. The codes are unpacked, dequantized and dotted in
registers; no dequantized key copy is written to HBM. Slots s >= lengths[b] are never loaded (masked loads),
so a cache buffer longer than the valid prefix costs nothing and its contents (even NaN) cannot leak in.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common


@dataclasses.dataclass(frozen=True)
class QuantScoresBlock:
  """Tiling of `quant_scores`. block_s: key slots per program (power of two, a multiple of group_size)."""
  block_s: int = 128
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _common.check_block_s(self.block_s, "QuantScoresBlock")
    _common.check_warps(self.num_warps, self.num_stages, "QuantScoresBlock")


def quant_scores_kernel(q_ref, codes_ref, scale_ref, zero_ref, len_ref, out_ref, *, bits: int,
                        group_size: int, sm_scale: float, n_rows: int, n_slots: int, dot_dtype):
  """One (b, k, S-block) program.

  q_ref [R, H] (R padded query rows, g-major), codes_ref [block_s, C] uint8, scale_ref/zero_ref
  [block_s/g, H], len_ref [] int32, out_ref [R, block_s] f32 (rows >= n_rows / slots >= n_slots lie
  outside the output array and are not stored).
  """
  block_s, n_bytes = codes_ref.shape
  n_groups, head_dim = scale_ref.shape
  r = q_ref.shape[0]
  j = pl.program_id(2)
  length = jnp.minimum(len_ref[()], n_slots)
  slots = j * block_s + jnp.arange(block_s)                                     # [block_s]
  valid = slots < length
  groups = j * n_groups + jnp.arange(n_groups)                                  # [block_s/g]
  group_valid = jnp.broadcast_to((groups * group_size < length)[:, None], (n_groups, head_dim))

  codes = plgpu.load(codes_ref, mask=jnp.broadcast_to(valid[:, None], (block_s, n_bytes)), other=0)
  scale = plgpu.load(scale_ref, mask=group_valid, other=0.0)
  zero = plgpu.load(zero_ref, mask=group_valid, other=0.0)
  k_hat = _common.dequant_keys_block(_common.unpack_block(codes, bits, head_dim), scale, zero,
                                     group_size)                                # [block_s, H]
  logits = _common.dot_nt(q_ref[...], k_hat, dot_dtype) * sm_scale              # [R, block_s]
  logits = jnp.where(valid[None, :], logits, -jnp.inf)
  rows = jnp.arange(r)
  store_mask = (rows[:, None] < n_rows) & (slots[None, :] < n_slots)            # [R, block_s]
  plgpu.store(out_ref, logits, mask=store_mask)


def _dot_dtype(dtype):
  return dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def _check_inputs(q, k_codes, k_scale, k_zero, lengths, bits, group_size, block):
  _common.check_quant_layout(bits, group_size, q.shape[-1], block.block_s)
  check_arrays(q, k_codes, k_scale, k_zero, lengths, bits, group_size)


def check_arrays(q, k_codes, k_scale, k_zero, lengths, bits, group_size):
  """The shapes and dtypes of `quant_scores`'s contract (also the TPU kernel's, `pallas_kernels.tpu.quant_scores`);
  each error names the value and the rule."""
  b, t, kh, g, h = q.shape
  if k_codes.shape[:2] != (b, kh):
    raise ValueError(f"k_codes.shape={k_codes.shape} must start with [B={b}, K={kh}] (q.shape={q.shape})")
  _common.check_key_arrays(k_codes, k_scale, k_zero, bits, group_size, h)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths (shape={lengths.shape}, dtype={lengths.dtype}) must be integer [B={b}]")


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale", "interpret", "block"))
def quant_scores(q, k_codes, k_scale, k_zero, lengths, *, bits: int, group_size: int, sm_scale: float,
                 interpret: bool = False, block: QuantScoresBlock | None = None) -> jax.Array:
  """Scaled logits of q against packed low-bit keys.

  q: [B, T, K, G, H]; k_codes: uint8 [B, K, S, C] (C = H·bits/8); k_scale, k_zero: [B, K, P, H] with
  P >= ceil(S / group_size); lengths: int [B] valid slots per row.
  Returns float32 [B, K, G, T, S]; columns s >= lengths[b] are -inf.
  """
  block = block or QuantScoresBlock()
  _check_inputs(q, k_codes, k_scale, k_zero, lengths, bits, group_size, block)
  t_real = q.shape[1]
  q = jnp.pad(q, ((0, 0), (0, _common.next_pow2(t_real) - t_real), (0, 0), (0, 0), (0, 0)))  # pow2 rows (Triton)
  b, t, kh, g, h = q.shape
  s, c = k_codes.shape[2], k_codes.shape[3]
  gp = _common.padded_heads(g, t)
  r = gp * t
  bs = block.block_s
  q_bkgth = jnp.pad(jnp.einsum("btkgh->bkgth", q), ((0, 0), (0, 0), (0, gp - g), (0, 0), (0, 0)))
  q_rows = q_bkgth.reshape(b, kh, r, h)                                         # [B, K, R, H], r = g·T + t
  kernel = functools.partial(quant_scores_kernel, bits=bits, group_size=group_size,
                             sm_scale=float(sm_scale), n_rows=g * t, n_slots=s,
                             dot_dtype=_dot_dtype(q.dtype))
  out = pl.pallas_call(
      kernel,
      grid=(b, kh, pl.cdiv(s, bs)),
      in_specs=[
          pl.BlockSpec((None, None, r, h), lambda i, k, j: (i, k, 0, 0)),
          pl.BlockSpec((None, None, bs, c), lambda i, k, j: (i, k, j, 0)),
          pl.BlockSpec((None, None, bs // group_size, h), lambda i, k, j: (i, k, j, 0)),
          pl.BlockSpec((None, None, bs // group_size, h), lambda i, k, j: (i, k, j, 0)),
          pl.BlockSpec((None,), lambda i, k, j: (i,)),
      ],
      out_specs=pl.BlockSpec((None, None, r, bs), lambda i, k, j: (i, k, 0, j)),
      out_shape=jax.ShapeDtypeStruct((b, kh, g * t, s), jnp.float32),
      compiler_params=_common.triton_params(block.num_warps, block.num_stages),
      interpret=interpret,
      name="quant_scores",
  )(q_rows, k_codes, k_scale, k_zero, lengths.astype(jnp.int32))
  return out.reshape(b, kh, g, t, s)[:, :, :, :t_real]                          # [B, K, G, T, S]


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale", "interpret", "block"))
def quant_scores_reference(q, k_codes, k_scale, k_zero, lengths, *, bits: int, group_size: int,
                           sm_scale: float, interpret: bool = False,
                           block: QuantScoresBlock | None = None) -> jax.Array:
  """float32 jnp reference with the kernel's signature (`interpret` and `block` are ignored)."""
  del interpret, block
  k_hat = _common.dequant_keys_reference(k_codes, k_scale, k_zero, bits, group_size)  # [B, K, S, H]
  logits = jnp.einsum("btkgh,bksh->bkgts", q.astype(jnp.float32), k_hat,
                      precision=jax.lax.Precision.HIGHEST) * sm_scale
  s = k_codes.shape[2]
  valid = jnp.arange(s)[None, :] < lengths[:, None]                             # [B, S]
  return jnp.where(valid[:, None, None, None, :], logits, -jnp.inf)
