"""Fused decode attention over a low-bit K/V cache plus a block of 16-bit extra columns.

For every (b, query head n, row t) one softmax over the union of
- low-bit columns s in [0, lowbit_len[b]) with dequantized K and V (keys: per-channel groups of g slots;
  values: per-token groups of g channels), except slots listed in exclude[b, k, :] (-1 = no entry): those
  rows are supplied in 16-bit among the extra columns;
- extra 16-bit columns e with extra_mask[b, k, t, e] (the caller's κ rows, residual window and new tokens;
  causality and dedup are the caller's, through the mask).
Query head n reads KV head n // G. Returns the output of every row and the probabilities of the last row
(t = T-1, the speculative row) averaged over the G query heads of each KV head, split into the low-bit part
[B, K, S] (0 where excluded or s >= lowbit_len) and the extra part [B, K, E]; with prob_rows=P, those of each of
the last P rows (t = T-P .. T-1; SpeCache's speculative candidates): [B, K, P, S] and [B, K, P, E].

GPU backend: Triton (`jax.experimental.pallas.triton.CompilerParams`), for the reasons given in
`quant_scores.py`: Mosaic GPU rejects the 8-bit pointwise unpacking and small decode tiles; Triton takes
int32-upcast unpacking, masked loads and power-of-two tiles (H, group_size, block_s powers of two; T padded to a
power of two with dummy rows first, whose outputs are dropped; query rows and the extra block padded to powers of
two >= 16 for tl.dot).

Schedule (flash-decoding): grid (B, K, splits). Program (b, k, j) holds the G·T query rows of KV head k and
runs an online softmax over the S-blocks of split j that lie below lowbit_len[b] (blocks past the length
are not visited, masked loads never touch slots past it); split 0 then adds the extra block. Each program
writes its unnormalised output, running max and sum; a jnp epilogue merges the splits (log-sum-exp).
Exclusion is an in-kernel comparison of the block's slot ids with exclude[b, k, :] (no dense mask in HBM).

Probabilities: the kernel stores the last P rows' scaled logits (-inf where masked) while it streams the
cache; after the merge gives the final max M and sum L of every head, the epilogue computes
mean_g exp(logit - M_g) / L_g. This costs P·G·4 bytes per slot written and read back, instead of a second
pass that would re-read and re-unpack the packed keys and their scales.

A row whose every column is masked yields output 0 and probabilities 0 (never NaN).

lowbit_values=False: the low-bit slots only score. The programs keep the running max and sum (the probabilities
are the same) but never load the value codes and scales; split 0 writes the softmax over the extra columns alone,
normalised, as the output (SpeCache's lowbit_in_output=False step and its scores-only passes).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common


@dataclasses.dataclass(frozen=True)
class MixedAttentionBlock:
  """Tiling of `mixed_decode_attention`.

  block_s: low-bit slots per inner step (power of two >= 16, a multiple of group_size);
  num_splits: most programs per (b, k) along S (flash-decoding; fewer when S has fewer blocks).
  """
  block_s: int = 128
  num_splits: int = 16
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _common.check_block_s(self.block_s, "MixedAttentionBlock")
    _common.check_warps(self.num_warps, self.num_stages, "MixedAttentionBlock")
    if self.num_splits < 1:
      raise ValueError(f"MixedAttentionBlock.num_splits={self.num_splits} must be >= 1")


def _online_update(carry, logits, v, dot_dtype):
  """One flash step. carry: o [R, H], m [R], l [R]; logits [R, S'] (-inf = masked); v [S', H], or None: the
  running max and sum only (o passes through)."""
  o, m, l = carry
  m_new = jnp.maximum(m, jnp.max(logits, axis=1))                               # [R]
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)                             # all-masked rows
  alpha = jnp.exp(m - m_safe)                                                   # [R]
  p = jnp.exp(logits - m_safe[:, None])                                         # [R, S']
  l_new = alpha * l + jnp.sum(p, axis=1)
  if v is None:
    return o, m_new, l_new
  o_new = alpha[:, None] * o + _common.dot_nn(p, v, dot_dtype)                  # [R, H]
  return o_new, m_new, l_new


def _softmax_output(logits, v, dot_dtype):
  """softmax(logits) · v over these columns alone, normalised; 0 for a row with every column masked."""
  r = logits.shape[0]
  o, _, l = _online_update((jnp.zeros((r, v.shape[1]), jnp.float32), jnp.full((r,), -jnp.inf, jnp.float32),
                            jnp.zeros((r,), jnp.float32)), logits, v, dot_dtype)
  return o * jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)[:, None]


def _row(logits, t_rows: int, t: int):
  """logits [Gp·T, X] (row g·T + t) -> [Gp, X] at row t, without value slicing (Triton has none)."""
  r, x = logits.shape
  by_t = logits.reshape(r // t_rows, t_rows, x)
  if t_rows == 1:
    return by_t.reshape(r, x)
  t_idx = lax.broadcasted_iota(jnp.int32, (1, t_rows, 1), 1)
  return jnp.max(jnp.where(t_idx == t, by_t, -jnp.inf), axis=1)


def _store_prob_rows(ref, cols, logits, t_rows: int, n_prob: int, head_ok):
  """ref[:, :, cols] [Pp, Gp, X] <- the logits [Gp·T, X] of rows t = T-P .. T-1 (only the real heads' rows)."""
  gp, x = ref.shape[1], logits.shape[1]
  for p in range(n_prob):
    plgpu.store(ref.at[pl.ds(p, 1), :, cols], _row(logits, t_rows, t_rows - n_prob + p)[None],
                mask=jnp.broadcast_to(head_ok[None, :, None], (1, gp, x)))


def mixed_decode_attention_kernel(
    q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, len_ref, excl_ref, ek_ref, ev_ref, em_ref,
    o_ref, m_ref, l_ref, low_ref, extra_ref, *, bits: int, group_size: int, sm_scale: float,
    t_rows: int, n_heads: int, n_slots: int, n_extra: int, block_s: int, dot_dtype, lowbit_values: bool,
    n_prob: int):
  """One (b, k, split) program.

  q_ref [R, H]; kc_ref/vc_ref [L, C] uint8 (L = this split's slots); ks_ref/kz_ref [L/g, H];
  vs_ref/vz_ref [L, H/g]; len_ref []; excl_ref [Xp] int32 (-1 = none); ek_ref/ev_ref [Ep, H];
  em_ref [T, Ep] int32. Outputs: o_ref [R, H], m_ref/l_ref [R] (unnormalised, this split only),
  low_ref [Pp, Gp, L] and extra_ref [Pp, Gp, Ep] (written by split 0): the logits of the last n_prob rows; only
  their first n_prob rows of n_heads = G heads exist in HBM (masked stores). lowbit_values=False: o_ref is split
  0's normalised output over the extra columns (0 in the other splits), the value refs are never read.
  """
  split_len, n_bytes = kc_ref.shape
  r, head_dim = q_ref.shape
  n_vgroups = vs_ref.shape[1]
  ep = ek_ref.shape[0]
  gp = r // t_rows
  kgroups = block_s // group_size
  j = pl.program_id(2)
  base = j * split_len
  length = jnp.minimum(len_ref[()], n_slots)
  q = q_ref[...]
  excl = excl_ref[...]
  head_ok = jnp.arange(gp) < n_heads                                            # [Gp] real query heads

  def body(i, carry):
    start = i * block_s
    slots = base + start + jnp.arange(block_s)                                  # [block_s]
    excluded = jnp.max((slots[:, None] == excl[None, :]).astype(jnp.int32), axis=1) > 0
    ok = (slots < length) & jnp.logical_not(excluded)                           # [block_s]
    group_ok = (base + start + jnp.arange(kgroups) * group_size) < length       # [block_s/g]
    gmask = jnp.broadcast_to(group_ok[:, None], (kgroups, head_dim))
    k_codes = plgpu.load(kc_ref.at[pl.ds(start, block_s), :],
                         mask=jnp.broadcast_to(ok[:, None], (block_s, n_bytes)), other=0)
    k_scale = plgpu.load(ks_ref.at[pl.ds(i * kgroups, kgroups), :], mask=gmask, other=0.0)
    k_zero = plgpu.load(kz_ref.at[pl.ds(i * kgroups, kgroups), :], mask=gmask, other=0.0)
    k_hat = _common.dequant_keys_block(_common.unpack_block(k_codes, bits, head_dim), k_scale, k_zero,
                                       group_size)                              # [block_s, H]
    logits = _common.dot_nt(q, k_hat, dot_dtype) * sm_scale                     # [R, block_s]
    logits = jnp.where(ok[None, :], logits, -jnp.inf)
    _store_prob_rows(low_ref, pl.ds(start, block_s), logits, t_rows, n_prob, head_ok)
    if not lowbit_values:
      return _online_update(carry, logits, None, dot_dtype)

    vmask = jnp.broadcast_to(ok[:, None], (block_s, n_vgroups))
    v_codes = plgpu.load(vc_ref.at[pl.ds(start, block_s), :],
                         mask=jnp.broadcast_to(ok[:, None], (block_s, n_bytes)), other=0)
    v_scale = plgpu.load(vs_ref.at[pl.ds(start, block_s), :], mask=vmask, other=0.0)
    v_zero = plgpu.load(vz_ref.at[pl.ds(start, block_s), :], mask=vmask, other=0.0)
    v_hat = _common.dequant_values_block(_common.unpack_block(v_codes, bits, head_dim), v_scale, v_zero,
                                         group_size)                            # [block_s, H]
    return _online_update(carry, logits, v_hat, dot_dtype)

  n_blocks = jnp.clip(pl.cdiv(length - base, block_s), 0, split_len // block_s)
  init = (jnp.zeros((r, head_dim), jnp.float32), jnp.full((r,), -jnp.inf, jnp.float32),
          jnp.zeros((r,), jnp.float32))
  carry = lax.fori_loop(0, n_blocks, body, init)

  # The extra 16-bit block: loaded and counted by split 0 only (other splits see it fully masked).
  first = j == 0
  e_in = (jnp.arange(ep) < n_extra) & first                                     # [Ep]
  em = plgpu.load(em_ref, mask=jnp.broadcast_to(e_in[None, :], (t_rows, ep)), other=0) > 0  # [T, Ep]
  row_mask = jnp.broadcast_to(em[None, :, :], (gp, t_rows, ep)).reshape(r, ep)   # [R, Ep]
  used = jnp.max(em.astype(jnp.int32), axis=0) > 0                              # [Ep] any row reads it
  umask = jnp.broadcast_to(used[:, None], (ep, head_dim))
  extra_k = plgpu.load(ek_ref, mask=umask, other=0.0)
  extra_v = plgpu.load(ev_ref, mask=umask, other=0.0)
  logits_e = _common.dot_nt(q, extra_k, dot_dtype) * sm_scale                    # [R, Ep]
  logits_e = jnp.where(row_mask, logits_e, -jnp.inf)
  if lowbit_values:
    o, m, l = _online_update(carry, logits_e, extra_v, dot_dtype)
  else:
    _, m, l = _online_update(carry, logits_e, None, dot_dtype)
    o = _softmax_output(logits_e, extra_v, dot_dtype)

  @pl.when(first)
  def _():
    _store_prob_rows(extra_ref, slice(None), logits_e, t_rows, n_prob, head_ok)

  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def _dot_dtype(dtype):
  return dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k,
                  extra_v, extra_mask, bits, group_size, block):
  _common.check_quant_layout(bits, group_size, q.shape[-1], block.block_s)
  check_arrays(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k, extra_v,
               extra_mask, bits, group_size)


def check_arrays(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k, extra_v,
                 extra_mask, bits, group_size):
  """The shapes and dtypes of `mixed_decode_attention`'s contract (also the CPU kernel's,
  `specache_jax.cpu_kernels.mixed_attention`); each error names the value and the rule."""
  b, t, n, h = q.shape
  kh, s = k_codes.shape[1], k_codes.shape[2]
  if k_codes.shape[0] != b or n % kh:
    raise ValueError(f"k_codes.shape={k_codes.shape} must be [B={b}, K, S, C] with K dividing N={n}")
  if h % group_size:
    raise ValueError(f"{group_size=} must divide head_dim={h} (values are grouped along channels)")
  _common.check_key_arrays(k_codes, k_scale, k_zero, bits, group_size, h)
  if v_codes.shape != k_codes.shape or v_codes.dtype != jnp.uint8:
    raise ValueError(f"v_codes (shape={v_codes.shape}, dtype={v_codes.dtype}) must be uint8 with "
                     f"k_codes.shape={k_codes.shape}")
  for name, x in (("v_scale", v_scale), ("v_zero", v_zero)):
    if x.shape != (b, kh, s, h // group_size):
      raise ValueError(f"{name}.shape={x.shape} must be [B, K, S, H/g] = {(b, kh, s, h // group_size)}")
  if lowbit_len.shape != (b,) or not jnp.issubdtype(lowbit_len.dtype, jnp.integer):
    raise ValueError(f"lowbit_len (shape={lowbit_len.shape}, dtype={lowbit_len.dtype}) must be int [B={b}]")
  if exclude.ndim != 3 or exclude.shape[:2] != (b, kh) or not jnp.issubdtype(exclude.dtype, jnp.integer):
    raise ValueError(f"exclude (shape={exclude.shape}, dtype={exclude.dtype}) must be int [B={b}, K={kh}, X]")
  e = extra_k.shape[2] if extra_k.ndim == 4 else 0
  for name, x in (("extra_k", extra_k), ("extra_v", extra_v)):
    if x.shape != (b, kh, e, h) or e < 1:
      raise ValueError(f"{name}.shape={x.shape} must be [B={b}, K={kh}, E>=1, H={h}] (same E for both)")
  if extra_mask.shape != (b, kh, t, e) or extra_mask.dtype != jnp.bool_:
    raise ValueError(f"extra_mask (shape={extra_mask.shape}, dtype={extra_mask.dtype}) must be bool "
                     f"[B, K, T, E] = {(b, kh, t, e)}")


def _splits(s: int, block: MixedAttentionBlock) -> tuple[int, int]:
  """(number of splits, slots per split); every split holds at least one block of S."""
  n_blocks = pl.cdiv(s, block.block_s)
  per_split = pl.cdiv(n_blocks, min(block.num_splits, n_blocks))
  return pl.cdiv(n_blocks, per_split), per_split * block.block_s


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale", "interpret", "block",
                                             "prob_rows", "lowbit_values"))
def mixed_decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude,
                           extra_k, extra_v, extra_mask, *, bits: int, group_size: int, sm_scale: float,
                           interpret: bool = False, block: MixedAttentionBlock | None = None,
                           prob_rows: int | None = None, lowbit_values: bool = True):
  """Mixed-precision decode attention (see the module docstring; lowbit_values=False: the low-bit slots only
  score, the output is the extra columns' own softmax; prob_rows: `check_prob_rows`).

  q: [B, T, N, H]; k_codes, v_codes: uint8 [B, K, S, C] (C = H·bits/8); k_scale, k_zero: [B, K, P, H]
  (P >= ceil(S/g)); v_scale, v_zero: [B, K, S, H/g]; lowbit_len: int [B]; exclude: int [B, K, X]
  (-1 = none); extra_k, extra_v: [B, K, E, H]; extra_mask: bool [B, K, T, E].
  Returns (out [B, T, N, H] in q.dtype, lowbit_probs f32 [B, K, S], extra_probs f32 [B, K, E]); with
  prob_rows=P the probabilities are [B, K, P, S] and [B, K, P, E].
  """
  block = block or MixedAttentionBlock()
  check_lowbit_values(lowbit_values)
  n_prob = check_prob_rows(prob_rows, q.shape[1])
  pp = _common.next_pow2(n_prob)
  _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k,
                extra_v, extra_mask, bits, group_size, block)
  t_real = q.shape[1]
  q, extra_mask = _pad_rows(q, 1), _pad_rows(extra_mask, 2)
  b, t, n, h = q.shape
  kh, s, c = k_codes.shape[1:]
  g, e, x = n // kh, extra_k.shape[2], exclude.shape[2]
  gp = _common.padded_heads(g, t)
  r = gp * t
  ep = max(_common.MIN_DOT_DIM, _common.next_pow2(e))
  xp = _common.next_pow2(max(x, 1))
  n_splits, split_len = _splits(s, block)
  q_bkgth = jnp.einsum("btkgh->bkgth", q.reshape(b, t, kh, g, h))
  q_rows = jnp.pad(q_bkgth, ((0, 0), (0, 0), (0, gp - g), (0, 0), (0, 0))).reshape(b, kh, r, h)
  excl = jnp.pad(exclude.astype(jnp.int32), ((0, 0), (0, 0), (0, xp - x)), constant_values=-1)
  kernel = functools.partial(
      mixed_decode_attention_kernel, bits=bits, group_size=group_size, sm_scale=float(sm_scale),
      t_rows=t, n_heads=g, n_slots=s, n_extra=e, block_s=block.block_s, dot_dtype=_dot_dtype(q.dtype),
      lowbit_values=lowbit_values, n_prob=n_prob)
  per_bk = lambda *shape: pl.BlockSpec((None, None) + shape, lambda i, k, j: (i, k) + (0,) * len(shape))
  per_split = lambda *shape: pl.BlockSpec((None, None) + shape, lambda i, k, j: (i, k, j, 0))
  f32 = jnp.float32
  o_part, m_part, l_part, low_logits, extra_logits = pl.pallas_call(
      kernel,
      grid=(b, kh, n_splits),
      in_specs=[
          per_bk(r, h),                                                         # q rows
          per_split(split_len, c),                                              # k codes
          per_split(split_len // group_size, h), per_split(split_len // group_size, h),
          per_split(split_len, c),                                              # v codes
          per_split(split_len, h // group_size), per_split(split_len, h // group_size),
          pl.BlockSpec((None,), lambda i, k, j: (i,)),                          # lowbit_len
          per_bk(xp),                                                           # exclude
          per_bk(ep, h), per_bk(ep, h),                                         # extra k, v
          per_bk(t, ep),                                                        # extra mask
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, r, h), lambda i, k, j: (i, k, j, 0, 0)),
          pl.BlockSpec((None, None, None, r), lambda i, k, j: (i, k, j, 0)),
          pl.BlockSpec((None, None, None, r), lambda i, k, j: (i, k, j, 0)),
          pl.BlockSpec((None, None, pp, gp, split_len), lambda i, k, j: (i, k, 0, 0, j)),
          per_bk(pp, gp, ep),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, kh, n_splits, r, h), f32),                  # o, unnormalised
          jax.ShapeDtypeStruct((b, kh, n_splits, r), f32),                     # running max
          jax.ShapeDtypeStruct((b, kh, n_splits, r), f32),                     # running sum
          jax.ShapeDtypeStruct((b, kh, n_prob, g, n_splits * split_len), f32), # last rows' low logits
          jax.ShapeDtypeStruct((b, kh, n_prob, g, ep), f32),                   # last rows' extra logits
      ],
      compiler_params=_common.triton_params(block.num_warps, block.num_stages),
      interpret=interpret,
      name="mixed_decode_attention",
  )(q_rows, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len.astype(jnp.int32), excl,
    extra_k, extra_v, extra_mask.astype(jnp.int32))
  out, p_low, p_extra = _merge(o_part, m_part, l_part, low_logits, extra_logits, lowbit_len, q.dtype, g=g, t=t,
                               s=s, e=e, lowbit_values=lowbit_values)
  out = out[:, t - t_real:]
  return (out, p_low[:, :, 0], p_extra[:, :, 0]) if prob_rows is None else (out, p_low, p_extra)


def _pad_rows(x, axis: int):
  """T rows -> the next power of two (Triton block shapes), dummy rows FIRST so the last P rows stay the last:
  zero queries in q, no extra column in extra_mask; their outputs are dropped."""
  t = x.shape[axis]
  pad = [(0, 0)] * x.ndim
  pad[axis] = (_common.next_pow2(t) - t, 0)
  return jnp.pad(x, pad)


def _merge(o_part, m_part, l_part, low_logits, extra_logits, lowbit_len, dtype, *, g, t, s, e, lowbit_values):
  """Log-sum-exp merge of the splits; output and the last P rows' probabilities [B, K, P, S] and [B, K, P, E]
  (see the module docstring; without the low-bit values the output is split 0's, already normalised)."""
  b, kh, _, r, h = o_part.shape
  gp = r // t
  m_all = jnp.max(m_part, axis=2)                                               # [B, K, R]
  m_safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
  w = jnp.exp(m_part - m_safe[:, :, None, :])                                   # [B, K, splits, R]
  l_all = jnp.sum(w * l_part, axis=2)                                           # [B, K, R]
  o_all = jnp.einsum("bkjr,bkjrh->bkrh", w, o_part, precision=lax.Precision.HIGHEST)
  inv_l = jnp.where(l_all > 0, 1.0 / jnp.where(l_all > 0, l_all, 1.0), 0.0)     # [B, K, R]
  o_bkgth = (o_all * inv_l[..., None] if lowbit_values else o_part[:, :, 0]).reshape(b, kh, gp, t, h)[:, :, :g]
  out = jnp.einsum("bkgth->btkgh", o_bkgth).reshape(b, t, kh * g, h).astype(dtype)
  n_prob = low_logits.shape[2]
  last_rows = lambda x: jnp.einsum("bkgp->bkpg", x.reshape(b, kh, gp, t)[:, :, :g, t - n_prob:])[..., None]
  m_last, inv_last = last_rows(m_safe), last_rows(inv_l)                        # [B, K, P, G, 1]
  valid = jnp.arange(s)[None, None, None, None, :] < lowbit_len[:, None, None, None, None]  # [B, 1, 1, 1, S]
  p_low = jnp.exp(low_logits[..., :s] - m_last) * inv_last                      # [B, K, P, G, S]
  p_low = jnp.where(valid, p_low, 0.0)                                          # unvisited blocks
  p_extra = jnp.exp(extra_logits[..., :e] - m_last) * inv_last
  return out, jnp.mean(p_low, axis=3), jnp.mean(p_extra, axis=3)


def check_lowbit_values(lowbit_values) -> None:
  """A clear error unless `lowbit_values` is a bool."""
  if not isinstance(lowbit_values, bool):
    raise ValueError(f"lowbit_values={lowbit_values!r} must be a bool (False: the low-bit slots only score)")


def check_prob_rows(prob_rows, t: int) -> int:
  """The rows whose probabilities come back: None (the last row's, [B, K, S]) or an int P in [1, T] (the last P
  rows', [B, K, P, S]; every kernel and the reference) -> P."""
  if prob_rows is None:
    return 1
  if isinstance(prob_rows, bool) or not isinstance(prob_rows, int) or not 1 <= prob_rows <= t:
    raise ValueError(f"prob_rows={prob_rows!r} must be None or an int in [1, T={t}] (the last rows whose "
                     "probabilities are returned)")
  return prob_rows


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale", "interpret", "block", "prob_rows",
                                             "lowbit_values"))
def mixed_decode_attention_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len,
                                     exclude, extra_k, extra_v, extra_mask, *, bits: int, group_size: int,
                                     sm_scale: float, interpret: bool = False,
                                     block: MixedAttentionBlock | None = None, prob_rows: int | None = None,
                                     lowbit_values: bool = True):
  """float32 jnp reference with the kernel's signature (`interpret` and `block` are ignored); `prob_rows` and
  `lowbit_values` as the XLA:CPU kernel's (`check_prob_rows`; False: the low-bit slots only score, the output is
  the softmax over the unmasked extra columns alone, 0 for a row without any)."""
  del interpret, block
  check_lowbit_values(lowbit_values)
  p_rows = check_prob_rows(prob_rows, q.shape[1])
  b, t, n, h = q.shape
  kh, s = k_codes.shape[1], k_codes.shape[2]
  g = n // kh
  hi = lax.Precision.HIGHEST
  q_btkgh = q.astype(jnp.float32).reshape(b, t, kh, g, h)
  slot = jnp.arange(s)
  excluded = jnp.any(slot[None, None, :, None] == exclude[:, :, None, :], axis=-1)  # [B, K, S]
  low_ok = (slot[None, None, :] < lowbit_len[:, None, None]) & ~excluded          # [B, K, S]
  # Slots past the length may hold anything (NaN included): zero them before any product.
  k_hat = jnp.where(low_ok[..., None],
                    _common.dequant_keys_reference(k_codes, k_scale, k_zero, bits, group_size), 0.0)
  v_hat = jnp.where(low_ok[..., None],
                    _common.dequant_values_reference(v_codes, v_scale, v_zero, bits, group_size), 0.0)
  used = jnp.any(extra_mask, axis=2)[..., None]                                   # [B, K, E, 1]
  ek = jnp.where(used, extra_k.astype(jnp.float32), 0.0)
  ev = jnp.where(used, extra_v.astype(jnp.float32), 0.0)
  logits_low = jnp.einsum("btkgh,bksh->bkgts", q_btkgh, k_hat, precision=hi) * sm_scale
  logits_low = jnp.where(low_ok[:, :, None, None, :], logits_low, -jnp.inf)
  logits_ext = jnp.einsum("btkgh,bkeh->bkgte", q_btkgh, ek, precision=hi) * sm_scale
  logits_ext = jnp.where(extra_mask[:, :, None, :, :], logits_ext, -jnp.inf)
  logits = jnp.concatenate([logits_low, logits_ext], axis=-1)                     # [B, K, G, T, S+E]
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  probs = p / jnp.where(denom > 0, denom, 1.0)
  if lowbit_values:
    values = jnp.concatenate([v_hat, ev], axis=2)                                 # [B, K, S+E, H]
    out = jnp.einsum("bkgtc,bkch->btkgh", probs, values, precision=hi).reshape(b, t, n, h)
  else:                                                                           # the extra columns' own softmax
    m_e = jnp.max(logits_ext, axis=-1, keepdims=True)
    p_e = jnp.exp(logits_ext - jnp.where(jnp.isfinite(m_e), m_e, 0.0))
    z_e = jnp.sum(p_e, axis=-1, keepdims=True)
    out = jnp.einsum("bkgte,bkeh->btkgh", p_e / jnp.where(z_e > 0, z_e, 1.0), ev, precision=hi).reshape(b, t, n, h)
  last = jnp.mean(probs[:, :, :, t - p_rows:, :], axis=2)                         # [B, K, P, S+E]
  if prob_rows is None:
    last = last[:, :, 0]
  return out.astype(q.dtype), last[..., :s], last[..., s:]
