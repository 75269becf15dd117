"""Fused decode attention over a low-bit K/V cache plus a block of 16-bit extra columns, Mosaic TPU kernel.

The contract and the float32 reference are `pallas_kernels.mixed_decode_attention`'s
(`mixed_decode_attention_reference`, with `prob_rows` and `lowbit_values`): for every (b, query head n, row t)
one softmax over the low-bit slots s < lowbit_len[b] not listed in exclude[b, k] and the extra columns e with
extra_mask[b, k, t, e]; query head n reads KV head n // G. Returns every row's output and the probabilities of
the last row (prob_rows=None: [B, K, S] and [B, K, E]) or of each of the last P rows (prob_rows=P: [B, K, P, S]
and [B, K, P, E]; SpeCache's speculative candidates), averaged over the G query heads of each KV head.

Schedule: grid (B, K, cdiv(S, block_s)), the S axis sequential ("arbitrary"), lowbit_len scalar-prefetched.
Program (b, k, j) holds the T·G query rows of KV head k, ordered by t descending (row (T-1-t)·G + g, padded with
zero rows to a multiple of 8), so the rows whose probabilities come back are the first P·G. Step 0 scores the
extra block and starts an online softmax (running max, sum and output in VMEM scratch); every step j with a
valid slot unpacks and dequantizes S-block j in VMEM (`tpu/_common.py`), masks the slots past the length (their
scales may be NaN: zeroed before any product) and the excluded ones (an in-kernel comparison with exclude), and
updates the softmax; the last step writes the normalised output and the running max and sum. Blocks past
lowbit_len[b] are neither fetched (the index maps repeat the last valid block) nor computed.

Probabilities: while it streams the cache the kernel writes the first P·G rows' scaled logits (-inf where
masked); a jnp epilogue turns them into mean_g exp(logit - M) / L with each row's final max M and sum L. This
costs P·G·4 bytes per slot written and read back instead of a second pass over the packed keys.

lowbit_values=False: the low-bit slots only score (the running max and sum, hence the probabilities, are the
same); the value codes and scales are never read, and the output is the softmax over the extra columns alone,
computed at step 0. A row whose every column is masked yields output 0 and probabilities 0 (never NaN).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import mixed_decode_attention as gpu_mixed
from pallas_kernels.tpu import _common


@dataclasses.dataclass(frozen=True)
class MixedAttentionTPUBlock:
  """Tiling of the TPU `mixed_decode_attention`. block_s: low-bit slots per grid step (a multiple of 128
  holding a multiple of 8 key groups)."""
  block_s: int = 512

  def __post_init__(self):
    _common.check_block_s(self.block_s, "MixedAttentionTPUBlock")


def _online_update(m_prev, l_prev, logits):
  """One flash step of the running max and sum. m_prev/l_prev [R, 1]; logits [R, X] (-inf = masked).
  -> (m_new, l_new, alpha [R, 1] the factor for the previous output, p [R, X])."""
  m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)                             # rows with nothing yet
  alpha = jnp.exp(m_prev - m_safe)
  p = jnp.exp(logits - m_safe)
  return m_new, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha, p


def mixed_decode_attention_kernel(
    len_ref, q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, excl_ref, ek_ref, ev_ref, em_ref, used_ref,
    o_ref, m_ref, l_ref, low_ref, extra_ref, m_sc, l_sc, acc_sc, *, bits: int, group_size: int,
    sm_scale: float, n_slots: int, dot_dtype, lowbit_values: bool):
  """One (b, k, S-block) program.

  len_ref SMEM [B]; q_ref [R, H]; kc_ref/vc_ref uint8 [block_s, C]; ks_ref/kz_ref [block_s/g, H];
  vs_ref/vz_ref [block_s, H/g]; excl_ref int32 [Xp, 1] (-1 = none); ek_ref/ev_ref [E, H]; em_ref int32 [R, E]
  (row r's mask); used_ref int32 [E, 1] (a row reads column e). Outputs: o_ref f32 [R, H] (normalised),
  m_ref/l_ref f32 [R, 128] (final max and sum, lane-replicated), low_ref f32 [P·G, block_s] and extra_ref f32
  [P·G, E] (the first P·G rows' logits). Scratch: m_sc/l_sc [R, 1], acc_sc [R, H].
  """
  r, head_dim = q_ref.shape
  kept = low_ref.shape[0]
  block_s = kc_ref.shape[0]
  j = pl.program_id(2)
  length = jnp.minimum(len_ref[pl.program_id(0)], n_slots)
  start = j * block_s

  @pl.when(j == 0)
  def _():
    q = q_ref[...]
    used = used_ref[...] > 0                                                     # [E, 1]
    ek = jnp.where(used, ek_ref[...].astype(jnp.float32), 0.0)                   # unread rows may be NaN
    ev = jnp.where(used, ev_ref[...].astype(jnp.float32), 0.0)
    logits = _common.dot_nt(q, ek, dot_dtype) * sm_scale                        # [R, E]
    logits = jnp.where(em_ref[...] > 0, logits, -jnp.inf)
    extra_ref[...] = logits[:kept]
    m, l, _, p = _online_update(jnp.full((r, 1), -jnp.inf, jnp.float32), jnp.zeros((r, 1), jnp.float32), logits)
    m_sc[...] = m
    l_sc[...] = l
    o = _common.dot_nn(p, ev, dot_dtype)                                         # [R, H]
    acc_sc[...] = o if lowbit_values else o * jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)

  @pl.when(start < length)
  def _():
    slot_col = start + lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
    slot_row = start + lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
    live_col = slot_col < length                                                 # [block_s, 1]
    excluded = jnp.max((excl_ref[...] == slot_row).astype(jnp.int32), axis=0, keepdims=True) > 0  # [1, block_s]
    ok_row = (slot_row < length) & jnp.logical_not(excluded)
    k_codes = _common.unpack(kc_ref[...], bits, head_dim).astype(jnp.float32)   # [block_s, H]
    k_hat = (k_codes * _common.expand_key_groups(ks_ref[...], group_size)
             + _common.expand_key_groups(kz_ref[...], group_size))
    k_hat = jnp.where(live_col, k_hat, 0.0)
    logits = _common.dot_nt(q_ref[...], k_hat, dot_dtype) * sm_scale             # [R, block_s]
    logits = jnp.where(ok_row, logits, -jnp.inf)
    low_ref[...] = logits[:kept]
    m, l, alpha, p = _online_update(m_sc[...], l_sc[...], logits)
    m_sc[...] = m
    l_sc[...] = l
    if lowbit_values:
      v_codes = _common.unpack(vc_ref[...], bits, head_dim).astype(jnp.float32)
      v_hat = (v_codes * _common.expand_value_groups(vs_ref[...], group_size, head_dim)
               + _common.expand_value_groups(vz_ref[...], group_size, head_dim))
      v_hat = jnp.where(live_col, v_hat, 0.0)                                    # p = 0 there; NaN·0 is not
      acc_sc[...] = alpha * acc_sc[...] + _common.dot_nn(p, v_hat, dot_dtype)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    l = l_sc[...]
    acc = acc_sc[...]
    o_ref[...] = acc * jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0) if lowbit_values else acc
    m_ref[...] = jnp.broadcast_to(m_sc[...], m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l, l_ref.shape)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale", "interpret", "block", "prob_rows",
                                             "lowbit_values"))
def mixed_decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude,
                           extra_k, extra_v, extra_mask, *, bits: int, group_size: int, sm_scale: float,
                           interpret=False, block: MixedAttentionTPUBlock | None = None,
                           prob_rows: int | None = None, lowbit_values: bool = True):
  """Mixed-precision decode attention on the TPU (see the module docstring).

  q: [B, T, N, H]; k_codes, v_codes: uint8 [B, K, S, C] (C = H·bits/8); k_scale, k_zero: [B, K, P, H]
  (P >= ceil(S/g)); v_scale, v_zero: [B, K, S, H/g]; lowbit_len: int [B]; exclude: int [B, K, X] (-1 = none);
  extra_k, extra_v: [B, K, E, H]; extra_mask: bool [B, K, T, E]. interpret: False, True (TPU interpret mode) or a
  `pltpu.InterpretParams`. Returns (out [B, T, N, H] in q.dtype, lowbit_probs f32, extra_probs f32):
  [B, K, S] and [B, K, E] for prob_rows=None (the last row), [B, K, P, S] and [B, K, P, E] for prob_rows=P.
  """
  block = block or MixedAttentionTPUBlock()
  gpu_mixed.check_lowbit_values(lowbit_values)
  n_prob = gpu_mixed.check_prob_rows(prob_rows, q.shape[1])
  _common.check_quant_layout(bits, group_size, q.shape[-1], block.block_s)
  gpu_mixed.check_arrays(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k,
                         extra_v, extra_mask, bits, group_size)
  b, t, n, h = q.shape
  kh, s, c = k_codes.shape[1:]
  g, e, x = n // kh, extra_k.shape[2], exclude.shape[2]
  bs, kg, vg = block.block_s, block.block_s // group_size, h // group_size
  r = _common.round_up(t * g, _common.SUBLANES)
  kept = n_prob * g                                                               # rows whose logits are kept
  xp = _common.round_up(max(x, 1), _common.SUBLANES)
  by_t_desc = lambda a: jnp.flip(a, axis=2)                                       # [B, K, T, ...], t descending
  q_bktgh = by_t_desc(jnp.einsum("btkgh->bktgh", q.reshape(b, t, kh, g, h)))
  q_rows = jnp.pad(q_bktgh.reshape(b, kh, t * g, h), ((0, 0), (0, 0), (0, r - t * g), (0, 0)))  # [B, K, R, H]
  em_bktge = jnp.broadcast_to(by_t_desc(extra_mask)[:, :, :, None, :], (b, kh, t, g, e))
  em_rows = jnp.pad(em_bktge.reshape(b, kh, t * g, e), ((0, 0), (0, 0), (0, r - t * g), (0, 0)))  # [B, K, R, E]
  used = jnp.any(extra_mask, axis=2)[..., None]                                   # [B, K, E, 1]
  excl = jnp.pad(exclude.astype(jnp.int32), ((0, 0), (0, 0), (0, xp - x)), constant_values=-1)[..., None]
  lens = jnp.clip(lowbit_len.astype(jnp.int32), 0, s)

  def s_block(i, k, j, len_ref):                  # [B, K, S, ...] inputs
    return (i, k, _common.clamped_block(len_ref[i], bs, j), 0)

  def s_block_out(i, k, j, len_ref):              # [B, K, Pp, S] logits
    return (i, k, 0, _common.clamped_block(len_ref[i], bs, j))

  per_bk = lambda *shape: pl.BlockSpec((None, None) + shape, lambda i, k, j, len_ref: (i, k) + (0,) * len(shape))
  if lowbit_values:
    v_specs = [pl.BlockSpec((None, None, bs, c), s_block), pl.BlockSpec((None, None, bs, vg), s_block),
               pl.BlockSpec((None, None, bs, vg), s_block)]
  else:                               # never read: left in HBM, not copied
    v_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 3
  kernel = functools.partial(
      mixed_decode_attention_kernel, bits=bits, group_size=group_size, sm_scale=float(sm_scale), n_slots=s,
      dot_dtype=_common.dot_dtype(q.dtype), lowbit_values=lowbit_values)
  f32 = jnp.float32
  o_rows, m_rows, l_rows, low_logits, extra_logits = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, kh, pl.cdiv(s, bs)),
          in_specs=[
              per_bk(r, h),                                                       # q rows
              pl.BlockSpec((None, None, bs, c), s_block),                         # k codes
              pl.BlockSpec((None, None, kg, h), s_block), pl.BlockSpec((None, None, kg, h), s_block),
              *v_specs,                                                           # v codes, scale, zero
              per_bk(xp, 1),                                                      # exclude
              per_bk(e, h), per_bk(e, h),                                         # extra k, v
              per_bk(r, e), per_bk(e, 1),                                         # row masks, used columns
          ],
          out_specs=[
              per_bk(r, h), per_bk(r, _common.LANES), per_bk(r, _common.LANES),
              pl.BlockSpec((None, None, kept, bs), s_block_out),                  # prob rows' low-bit logits
              per_bk(kept, e),
          ],
          scratch_shapes=[pltpu.VMEM((r, 1), f32), pltpu.VMEM((r, 1), f32), pltpu.VMEM((r, h), f32)],
      ),
      out_shape=[
          jax.ShapeDtypeStruct((b, kh, r, h), f32),
          jax.ShapeDtypeStruct((b, kh, r, _common.LANES), f32),
          jax.ShapeDtypeStruct((b, kh, r, _common.LANES), f32),
          jax.ShapeDtypeStruct((b, kh, kept, s), f32),
          jax.ShapeDtypeStruct((b, kh, kept, e), f32),
      ],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=_common.interpret_params(interpret),
      name="mixed_decode_attention_tpu",
  )(lens, q_rows, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, excl, extra_k, extra_v,
    em_rows.astype(jnp.int32), used.astype(jnp.int32))
  out_bktgh = by_t_desc(o_rows[:, :, :t * g].reshape(b, kh, t, g, h))
  out = jnp.einsum("bktgh->btkgh", out_bktgh).reshape(b, t, n, h).astype(q.dtype)
  p_low, p_extra = _probabilities(m_rows[..., 0], l_rows[..., 0], low_logits, extra_logits, lens, g=g,
                                  n_prob=n_prob)
  return (out, p_low[:, :, 0], p_extra[:, :, 0]) if prob_rows is None else (out, p_low, p_extra)


def _probabilities(m_rows, l_rows, low_logits, extra_logits, lens, *, g: int, n_prob: int):
  """mean_g exp(logit - M) / L of the first n_prob·G rows (t = T-1, T-2, ...) -> ([B, K, P, S], [B, K, P, E])
  with P in ascending t (the reference's order); slots past the length (never written) are 0."""
  b, kh, _, s = low_logits.shape
  rows = n_prob * g
  m = m_rows[:, :, :rows]
  m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]                                # [B, K, P·G, 1]
  l = l_rows[:, :, :rows]
  inv_l = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)[..., None]

  def mean_over_heads(logits):                                                     # [B, K, P·G, X] -> [B, K, P, X]
    p = jnp.exp(logits - m) * inv_l
    return jnp.flip(jnp.mean(p.reshape(b, kh, n_prob, g, p.shape[-1]), axis=3), axis=2)

  valid = (jnp.arange(s)[None, :] < lens[:, None])[:, None, None, :]               # [B, 1, 1, S]
  return jnp.where(valid, mean_over_heads(low_logits), 0.0), mean_over_heads(extra_logits)
