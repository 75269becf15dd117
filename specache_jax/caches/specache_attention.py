"""SpeCache's attention of a decoding step's new rows over its mixed cache (`mixed_attention`): κ's fetched rows and
the residual ring in 16-bit, every other stored position through the low-bit copy, the new rows last — as jnp ops
or a fused kernel (XLA:CPU, Pallas Triton or Pallas Mosaic TPU: `specache_jax.dispatch` picks by
`attention_impl`), one contract (`pallas_kernels.mixed_decode_attention`). Split from
`specache.py`, whose State (`st`) and SpeCacheConfig (`method`) it reads. Axis letters as in caches/attention.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specache_jax import dispatch
from specache_jax.caches import attention as A
from specache_jax.caches import lowbit
from specache_jax.caches import selection
from specache_jax.caches.hit_stats import membership


def mixed_attention(method, st, q, kn_BKTH, vn_BKTH, lengths, use_kappa: bool,
                    rows: tuple[int, ...] = (-1,), scores_only: bool = False):
  """Attention of the T new rows over every stored position (κ rows and the ring in 16-bit, the rest
  low-bit; with use_kappa and lowbit_in_output=False the output attends κ, the ring and the new rows only,
  the probabilities still cover every position) and the new rows. Returns out [B,T,N,H] and, for each of
  `rows` (default: the LAST row), its probabilities per position averaged over each group, as `Scores`
  (`.dense()`: [B, K, len(rows), S] float32, the new rows' columns at their positions n + `row_offsets`;
  `select_row` picks κ from them without it). The fused kernels (`dispatch.mixed_attention`, by
  attention_impl) take every row set that is the last len(rows) rows in order (`prob_rows`); any other takes jnp.

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

  trailing = tuple(r % t for r in rows) == tuple(range(t - len(rows), t))      # the kernels' prob_rows
  if trailing:
    # The kernels skip the low-bit values where the output leaves them out (`lowbit_values=False`): they give the
    # `sixteen_out` output themselves, and with scores_only an output nobody reads.
    extra_mask = jnp.concatenate([ring_mask, kap_mask, jnp.broadcast_to(new_mask, (b, n_kv, t, t))], -1)
    out, probs_low, probs_extra = dispatch.mixed_attention(
        method.attention_impl, jnp_attention, q, st.low, val_qlen, exclude,
        [x.astype(q.dtype) for x in (ring_k, st.fetched_k, kn_BKTH)],
        [x.astype(q.dtype) for x in (ring_v, st.fetched_v, vn_BKTH)], extra_mask, bits=method.bits,
        group_size=method.group_size, sm_scale=sm_scale, prob_rows=len(rows),
        lowbit_values=not (scores_only or sixteen_out))
  else:
    out, probs_low, probs_extra = jnp_attention()
  new_pos = jnp.broadcast_to((lengths[:, None] + jnp.asarray(offsets)[None, :])[:, None, :], (b, n_kv, t))
  extra_pos = jnp.concatenate([ring_pos, kappa, new_pos], axis=-1)         # [B, K, R + X + T]
  extra_ok = jnp.concatenate([ring_ok, kap_use, jnp.ones((b, n_kv, t), bool)], axis=-1)
  idx = jnp.where(extra_ok, extra_pos, s).astype(jnp.int32)                 # invalid -> no position (S)
  return out, selection.Scores(probs_low, probs_extra, idx)
