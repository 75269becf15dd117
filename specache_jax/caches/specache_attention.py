"""SpeCache's attention of a decoding step's new rows over its mixed cache (`mixed_attention`): κ's fetched rows and
the residual ring in 16-bit, every other stored position through the low-bit copy, the new rows last — as jnp ops,
the Pallas kernel or the XLA:CPU kernel, one contract (`pallas_kernels.mixed_decode_attention`). Split from
`specache.py`, whose State (`st`) and SpeCacheConfig (`method`) it reads. Axis letters as in caches/attention.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mixed_decode_attention import mixed_decode_attention
from specache_jax import cpu_kernels as ck
from specache_jax.caches import attention as A
from specache_jax.caches import lowbit
from specache_jax.caches import selection
from specache_jax.caches.hit_stats import membership
from specache_jax.cpu_kernels import mixed_attention as cpu_attention


def mixed_attention(method, st, q, kn_BKTH, vn_BKTH, lengths, use_kappa: bool,
                    rows: tuple[int, ...] = (-1,), scores_only: bool = False):
  """Attention of the T new rows over every stored position (κ rows and the ring in 16-bit, the rest
  low-bit; with use_kappa and lowbit_in_output=False the output attends κ, the ring and the new rows only,
  the probabilities still cover every position) and the new rows. Returns out [B,T,N,H] and, for each of
  `rows` (default: the LAST row), its probabilities per position averaged over each group, as `Scores`
  (`.dense()`: [B, K, len(rows), S] float32, the new rows' columns at their positions n + `row_offsets`;
  `select_row` picks κ from them without it). The fused kernels: Pallas (attention_impl; the last row's only)
  and, for attention_impl="jnp" on XLA:CPU, `cpu_kernels.mixed_attention` where it `applies` and rows are the
  last len(rows) rows in order.

  st's ring is the one from before this step's row (`attend` stores the row's codes first, so the big buffers
  are written in place — the codes it wrote are at positions this attention masks — and the ring after).
  scores_only: the caller uses only the probabilities; the output returned is then not the attention's (the
  fused kernels do not read the low-bit values for it)."""
  b, t, _, h = q.shape
  n_kv = kn_BKTH.shape[1]
  _, val_qlen = lowbit.boundaries(lengths, method.residual)
  spec = method.speculation
  exact_from = method.sixteen_bit_from(lengths)
  s = st.low.k_codes.shape[2]
  kappa = st.kappa
  x = kappa.shape[-1]
  if use_kappa and x:
    kap_use = (kappa < exact_from[:, None, None]) & (kappa >= 0)         # else the ring has it in 16-bit
  else:
    kap_use = jnp.zeros(kappa.shape, bool)
  kap_set = jnp.where(kap_use, kappa, -2)
  ring_k, ring_v, ring_pos = lowbit.ring_segment(st.low, lengths, bits=method.bits, group_size=method.group_size,
                                                 residual=method.residual, exact_keys=spec.exact_ring)
  ring_ok = (ring_pos >= 0) & ~membership(ring_pos, kap_set)             # [B, K, R]
  kap_mask = jnp.broadcast_to(kap_use[:, :, None, :], (b, n_kv, t, x))
  ring_mask = jnp.broadcast_to(ring_ok[:, :, None, :], (b, n_kv, t, method.residual))
  offsets = spec.row_offsets(t)
  new_mask = A.new_rows_mask(b, offsets)
  sm_scale = h ** -0.5
  exclude = jnp.where(kap_use, kappa, -1)
  sixteen_out = use_kappa and not spec.lowbit_in_output          # the output attends the 16-bit columns only

  def sixteen_bit_output():
    """The output over κ_t's rows, the ring and the new rows only (`sixteen_out`: the low-bit copy only scores)."""
    return A.segmented_attention(q, [(ring_k, ring_v, ring_mask), (st.fetched_k, st.fetched_v, kap_mask),
                                     (kn_BKTH, vn_BKTH, new_mask)], sm_scale, n_kv)[0]

  def jnp_attention():
    excluded = jnp.zeros((b, n_kv, s + 1), bool)
    excluded = jax.vmap(jax.vmap(lambda e, i: e.at[i].set(True)))(excluded, jnp.where(kap_use, kappa, s))
    low_ok = (jnp.arange(s)[None, None, :] < val_qlen[:, None, None]) & ~excluded[:, :, :s]
    low_mask = jnp.broadcast_to(low_ok[:, :, None, :], (b, n_kv, t, s))
    packed = lowbit.packed_segment(st.low, low_mask, bits=method.bits, group_size=method.group_size)
    out, (p_low, p_ring, p_kap, p_new) = A.segmented_attention(
        q, [packed, (ring_k, ring_v, ring_mask), (st.fetched_k, st.fetched_v, kap_mask),
            (kn_BKTH, vn_BKTH, new_mask)], sm_scale, n_kv)
    of_rows = lambda p: jnp.stack([jnp.mean(p[:, :, :, r, :], axis=2) for r in rows], axis=2)  # [B,K,rows,cols]
    out = sixteen_bit_output() if sixteen_out else out
    return out, of_rows(p_low), jnp.concatenate([of_rows(p_ring), of_rows(p_kap), of_rows(p_new)], -1)

  def fused_attention(kernel, prob_rows=None):
    """The Pallas kernel (the last row's probabilities only) or the CPU kernel (the last `prob_rows` rows'). Both
    skip the low-bit values where the output leaves them out (`lowbit_values=False`): they give the `sixteen_out`
    output themselves, and with scores_only an output nobody reads."""
    by_kernel = scores_only or sixteen_out
    if prob_rows is None and tuple(r % t for r in rows) != (t - 1,):
      raise ValueError(f"{rows=}: the Pallas attention kernel returns the last row's probabilities only")
    extra_k = [ring_k.astype(q.dtype), st.fetched_k.astype(q.dtype), kn_BKTH.astype(q.dtype)]
    extra_v = [ring_v.astype(q.dtype), st.fetched_v.astype(q.dtype), vn_BKTH.astype(q.dtype)]
    if prob_rows is None:                   # Pallas: one array each; the CPU kernel reads the segments in place
      extra_k, extra_v = jnp.concatenate(extra_k, axis=2), jnp.concatenate(extra_v, axis=2)
    extra_mask = jnp.concatenate([ring_mask, kap_mask, jnp.broadcast_to(new_mask, (b, n_kv, t, t))], -1)
    kw = dict(lowbit_values=not by_kernel) if prob_rows is None else dict(prob_rows=prob_rows,
                                                                          lowbit_values=not by_kernel)
    out, p_low, p_extra = kernel(
        q, st.low.k_codes, st.low.k_scale, st.low.k_zero, st.low.v_codes, st.low.v_scale, st.low.v_zero,
        val_qlen, exclude, extra_k, extra_v, extra_mask, bits=method.bits, group_size=method.group_size,
        sm_scale=sm_scale, **kw)
    return (out, p_low[:, :, None], p_extra[:, :, None]) if prob_rows is None else (out, p_low, p_extra)

  if method.attention_impl != "jnp":
    out, probs_low, probs_extra = fused_attention(functools.partial(
        mixed_decode_attention, interpret=method.attention_impl == "pallas_interpret"))
  else:   # XLA:CPU: the fused kernel where it applies; a program lowered for another platform keeps the jnp ops
    trailing = tuple(r % t for r in rows) == tuple(range(t - len(rows), t))      # the kernel's prob_rows
    out, probs_low, probs_extra = ck.on_cpu(
        trailing and cpu_attention.applies(method.bits, method.group_size, h),
        lambda: fused_attention(cpu_attention.mixed_decode_attention, len(rows)), jnp_attention)
  new_pos = jnp.broadcast_to((lengths[:, None] + jnp.asarray(offsets)[None, :])[:, None, :], (b, n_kv, t))
  extra_pos = jnp.concatenate([ring_pos, kappa, new_pos], axis=-1)         # [B, K, R + X + T]
  extra_ok = jnp.concatenate([ring_ok, kap_use, jnp.ones((b, n_kv, t), bool)], axis=-1)
  idx = jnp.where(extra_ok, extra_pos, s).astype(jnp.int32)                 # invalid -> no position (S)
  return out, selection.Scores(probs_low, probs_extra, idx)
