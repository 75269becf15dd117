"""Scores of the query rows of every query head against bit-packed low-bit keys, Mosaic TPU kernel.

The contract and the float32 reference are `pallas_kernels.quant_scores`'s (`quant_scores_reference`):
logits[b, k, g, t, s] = sm_scale · q[b, t, k, g, :] · k̂[b, k, s, :], with k̂[s, h] = code[s, h] · scale[s // g, h]
+ zero[s // g, h], and -inf for s >= lengths[b].

Grid (B, K, cdiv(S, block_s)), lengths scalar-prefetched into SMEM. Program (b, k, j) scores the G·T query rows
of KV head k (row g·T + t; the query block zero-padded to a multiple of 8 rows, the output holding the G·T
real rows only) against S-block j: the codes are unpacked and
dequantized in VMEM (`tpu/_common.py`) and dotted on the MXU; no dequantized key copy is written to HBM. The
index maps send every block past lengths[b] to the last valid one (the same index twice in a row is not fetched
again), and those programs write -inf without computing. Inside the last valid block the slots past the length
are zeroed before the dot (their scales may hold anything, NaN included) and scored -inf.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import quant_scores as gpu_quant_scores
from pallas_kernels.tpu import _common


@dataclasses.dataclass(frozen=True)
class QuantScoresTPUBlock:
  """Tiling of the TPU `quant_scores`. block_s: key slots per program (a multiple of 128 holding a multiple of
  8 key groups)."""
  block_s: int = 512

  def __post_init__(self):
    _common.check_block_s(self.block_s, "QuantScoresTPUBlock")


def quant_scores_kernel(len_ref, q_ref, codes_ref, scale_ref, zero_ref, out_ref, *, bits: int, group_size: int,
                        sm_scale: float, n_slots: int, dot_dtype):
  """One (b, k, S-block) program. len_ref SMEM [B]; q_ref [R, H]; codes_ref uint8 [block_s, C];
  scale_ref/zero_ref [block_s/g, H]; out_ref f32 [G·T, block_s] (the first G·T of the R query rows)."""
  head_dim = q_ref.shape[1]
  n_rows = out_ref.shape[0]
  block_s = codes_ref.shape[0]
  j = pl.program_id(2)
  length = jnp.minimum(len_ref[pl.program_id(0)], n_slots)
  start = j * block_s

  @pl.when(start < length)
  def _():
    slot_col = start + lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
    slot_row = start + lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
    codes = _common.unpack(codes_ref[...], bits, head_dim).astype(jnp.float32)       # [block_s, H]
    k_hat = (codes * _common.expand_key_groups(scale_ref[...], group_size)
             + _common.expand_key_groups(zero_ref[...], group_size))
    k_hat = jnp.where(slot_col < length, k_hat, 0.0)                                   # NaN past the length
    logits = _common.dot_nt(q_ref[...], k_hat, dot_dtype) * sm_scale                   # [R, block_s]
    out_ref[...] = jnp.where(slot_row < length, logits[:n_rows], -jnp.inf)

  @pl.when(start >= length)
  def _():
    out_ref[...] = jnp.full((n_rows, block_s), -jnp.inf, jnp.float32)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale", "interpret", "block"))
def quant_scores(q, k_codes, k_scale, k_zero, lengths, *, bits: int, group_size: int, sm_scale: float,
                 interpret=False, block: QuantScoresTPUBlock | None = None) -> jax.Array:
  """Scaled logits of q against packed low-bit keys (`pallas_kernels.quant_scores.quant_scores`'s contract).

  q: [B, T, K, G, H]; k_codes: uint8 [B, K, S, C] (C = H·bits/8); k_scale, k_zero: [B, K, P, H] with
  P >= ceil(S / group_size); lengths: int [B] valid slots per row. interpret: False, True (TPU interpret mode)
  or a `pltpu.InterpretParams`. Returns float32 [B, K, G, T, S]; columns s >= lengths[b] are -inf.
  """
  block = block or QuantScoresTPUBlock()
  b, t, kh, g, h = q.shape
  _common.check_quant_layout(bits, group_size, h, block.block_s)
  gpu_quant_scores.check_arrays(q, k_codes, k_scale, k_zero, lengths, bits, group_size)
  s, c = k_codes.shape[2], k_codes.shape[3]
  bs, kg = block.block_s, block.block_s // group_size
  r = _common.round_up(g * t, _common.SUBLANES)
  q_rows = jnp.einsum("btkgh->bkgth", q).reshape(b, kh, g * t, h)                  # [B, K, G·T, H]
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, r - g * t), (0, 0)))               # [B, K, R, H]
  lens = jnp.clip(lengths.astype(jnp.int32), 0, s)

  def s_block(i, k, j, len_ref):
    return (i, k, _common.clamped_block(len_ref[i], bs, j), 0)

  kernel = functools.partial(quant_scores_kernel, bits=bits, group_size=group_size, sm_scale=float(sm_scale),
                             n_slots=s, dot_dtype=_common.dot_dtype(q.dtype))
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, kh, pl.cdiv(s, bs)),
          in_specs=[
              pl.BlockSpec((None, None, r, h), lambda i, k, j, len_ref: (i, k, 0, 0)),
              pl.BlockSpec((None, None, bs, c), s_block),
              pl.BlockSpec((None, None, kg, h), s_block),
              pl.BlockSpec((None, None, kg, h), s_block),
          ],
          out_specs=pl.BlockSpec((None, None, g * t, bs), lambda i, k, j, len_ref: (i, k, 0, j)),
      ),
      out_shape=jax.ShapeDtypeStruct((b, kh, g * t, s), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=_common.interpret_params(interpret),
      name="quant_scores_tpu",
  )(lens, q_rows, k_codes, k_scale, k_zero)
  return out.reshape(b, kh, g, t, s)                                               # [B, K, G, T, S]
