"""`mixed_decode_attention` on XLA:CPU: the contract (and the float32 jnp reference) of
`pallas_kernels.mixed_decode_attention`, as one custom call (`mixed_attention.cc`).

A SpeCache decoding step's attention over the low-bit cache, the κ rows, the residual ring and the new tokens
is ~100 small XLA ops per layer on the CPU (key scores, softmax, blockwise value sums, group means of the
probabilities); at 8k slots they took ~35 of a step's ~85 thread-ms (SmolLM2-135M, 1-bit). The kernel reads
the packed codes once per (KV head, chunk of slots) for all G·T query rows of the head and fuses the rest.

The extra 16-bit columns' keys and values may come in up to three segments (a sequence of [B, K, E_i, H] arrays
standing for their concatenation along E): SpeCache passes the ring, the κ rows and the new rows where they are,
without XLA copying them into one array first (~20 µs per layer and array at 8k, batch 1).

`supports(...)` says which layouts it takes (b in {1, 2, 4, 8}; H in 16, 32, 64, 128; float32 scales
are converted); SpeCache's and KIVI's jnp attention take it on the CPU backend where it `applies`
(`caches/specache.py`, `caches/kivi.py`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mixed_decode_attention import check_arrays, check_lowbit_values, check_prob_rows
from specache_jax import cpu_kernels as ck

BITS = (1, 2, 4, 8)
HEAD_DIMS = (16, 32, 64, 128)


def supports(bits: int, group_size: int, head_dim: int) -> bool:
  """Whether the kernel takes this layout: b in BITS, H in HEAD_DIMS with H·b/8 bytes a multiple of 4, g dividing
  H (the value groups)."""
  return (bits in BITS and head_dim in HEAD_DIMS and (head_dim * bits // 8) % 4 == 0
          and group_size >= 1 and head_dim % group_size == 0)


def applies(bits: int, group_size: int, head_dim: int) -> bool:
  """Whether `specache_jax.dispatch` may take the kernel: a layout it `supports` and the kernels built
  (`cpu_kernels.available()`; off with SPECACHE_JAX_CPU_KERNELS=0)."""
  return supports(bits, group_size, head_dim) and ck.available()


MAX_SEGMENTS = 3     # extra key/value segments the kernel reads in place (more are concatenated into the last)


def extra_segments(extra_k, extra_v) -> tuple[tuple, tuple]:
  """The extra keys and values as MAX_SEGMENTS segments each (one array or a sequence of [B, K, E_i, H] arrays,
  the same split for keys and values); a clear error for anything else."""
  ks = tuple(extra_k) if isinstance(extra_k, (tuple, list)) else (extra_k,)
  vs = tuple(extra_v) if isinstance(extra_v, (tuple, list)) else (extra_v,)
  shapes = lambda xs: [getattr(x, "shape", None) for x in xs]
  if (not ks or len(ks) != len(vs) or any(getattr(x, "ndim", 0) != 4 for x in ks + vs)
      or shapes(ks) != shapes(vs) or len({(x.shape[:2], x.shape[3]) for x in ks}) != 1):
    raise ValueError(f"extra_k / extra_v must be arrays [B, K, E, H] or sequences of [B, K, E_i, H] segments split "
                     f"alike; got {shapes(ks)} and {shapes(vs)}")
  if len(ks) > MAX_SEGMENTS:
    ks = ks[:MAX_SEGMENTS - 1] + (jnp.concatenate(ks[MAX_SEGMENTS - 1:], axis=2),)
    vs = vs[:MAX_SEGMENTS - 1] + (jnp.concatenate(vs[MAX_SEGMENTS - 1:], axis=2),)
  b, kh, _, h = ks[0].shape
  empty = jnp.zeros((b, kh, 0, h), jnp.float32)
  pad = (empty,) * (MAX_SEGMENTS - len(ks))
  return ks + pad, vs + pad


def _check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k, extra_v,
           extra_mask, bits: int, group_size: int) -> None:
  h = q.shape[-1]
  if not supports(bits, group_size, h):
    raise ValueError(f"mixed_decode_attention (CPU kernel): {bits=}, {group_size=}, head_dim={h} is not a layout "
                     f"it takes (bits in {BITS}, head_dim in {HEAD_DIMS}, group_size dividing head_dim)")
  check_arrays(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k, extra_v,
               extra_mask, bits, group_size)


def mixed_decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, extra_k,
                           extra_v, extra_mask, *, bits: int, group_size: int, sm_scale: float,
                           prob_rows: int | None = None, lowbit_values: bool = True):
  """Mixed-precision decode attention (`pallas_kernels.mixed_decode_attention`'s contract and reference, whose
  `prob_rows` and `lowbit_values` it shares: with lowbit_values=False the low-bit slots only score — their values
  are never read — and the output is the softmax over the extra columns alone).

  q: [B, T, N, H]; k_codes, v_codes: uint8 [B, K, S, C] (C = H·bits/8); k_scale, k_zero: [B, K, P, H]
  (P >= ceil(S/g)); v_scale, v_zero: [B, K, S, H/g]; lowbit_len: int [B]; exclude: int [B, K, X]
  (-1 = none); extra_k, extra_v: [B, K, E, H], or each a sequence of segments [B, K, E_i, H] split alike (their
  concatenation along E, read in place); extra_mask: bool [B, K, T, E].
  Returns (out [B, T, N, H] in q.dtype, lowbit_probs f32 [B, K, S], extra_probs f32 [B, K, E]): the last row's
  probabilities averaged over each KV head's G query heads; with prob_rows=P, those of each of the last P rows,
  [B, K, P, S] and [B, K, P, E]. CPU backend only; on a CPU mesh the batch axis keeps its sharding (everything else
  is gathered)."""
  ks, vs = extra_segments(extra_k, extra_v)
  whole = jax.ShapeDtypeStruct(ks[0].shape[:2] + (sum(x.shape[2] for x in ks),) + ks[0].shape[3:], ks[0].dtype)
  _check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lowbit_len, exclude, whole, whole, extra_mask,
         bits, group_size)
  p = check_prob_rows(prob_rows, q.shape[1])
  check_lowbit_values(lowbit_values)
  if not ck.available():
    raise RuntimeError(f"mixed_decode_attention: CPU kernels {ck.status()}")
  b, t, n, h = q.shape
  kh = k_codes.shape[1]
  g = n // kh
  f32 = jnp.float32
  q_rows = jnp.transpose((q.astype(f32) * f32(sm_scale)).reshape(b, t, kh, g, h), (0, 2, 3, 1, 4))
  args = (q_rows.reshape(b, kh, g * t, h), k_codes, k_scale.astype(f32), k_zero.astype(f32), v_codes,
          v_scale.astype(f32), v_zero.astype(f32), lowbit_len.astype(jnp.int32), exclude.astype(jnp.int32),
          *(x.astype(f32) for x in ks + vs), extra_mask.astype(jnp.uint8))
  out, p_low, p_extra = _batch_partitioned(bits, group_size, t, p, lowbit_values)(*args)
  out = jnp.transpose(out.reshape(b, kh, g, t, h), (0, 3, 1, 2, 4)).reshape(b, t, n, h)
  if prob_rows is None:
    p_low, p_extra = p_low[:, :, 0], p_extra[:, :, 0]
  return out.astype(q.dtype), p_low, p_extra


def _call(bits: int, group_size: int, t: int, p: int, values: bool, q_rows, k_codes, *rest):
  b, kh, m, h = q_rows.shape
  s, e = k_codes.shape[2], rest[-1].shape[3]     # rest ends with the extra mask [B, K, T, E]
  outs = (jax.ShapeDtypeStruct((b, kh, m, h), jnp.float32), jax.ShapeDtypeStruct((b, kh, p, s), jnp.float32),
          jax.ShapeDtypeStruct((b, kh, p, e), jnp.float32))
  return tuple(jax.ffi.ffi_call(ck.ATTENTION_TARGET, outs, vmap_method="sequential")(
      q_rows, k_codes, *rest, bits=bits, group_size=group_size, t_rows=t, prob_rows=p, lowbit_values=values))


@functools.cache
def _batch_partitioned(bits: int, group_size: int, t: int, p: int, values: bool):
  """The custom call for the SPMD partitioner: the batch axis keeps its sharding (`cpu_kernels.batch_partitioned`)."""
  segs = ", ".join(f"b k e{i} h" for i in range(MAX_SEGMENTS))
  rule = (f"b k m h, b k s c, b k p h, b k p h, b k s c, b k s v, b k s v, b, b k x, {segs}, {segs}, b k t e "
          "-> b k m h, b k r s, b k r e")
  return ck.batch_partitioned(functools.partial(_call, bits, group_size, t, p, values), rule, 3,
                              ("k", "m", "h", "s", "c", "p", "v", "x") + tuple(f"e{i}" for i in range(MAX_SEGMENTS))
                              + ("t", "e", "r"))       # in the rule's order (Shardy wants them sorted)
