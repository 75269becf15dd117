"""SpeCache's per-step measurements: how well κ_t served the real row (`hit_stats`, with track_hits) and how far
the real query drifted from the speculative one that chose κ_t (`query_drift`).
`method` is a `specache.SpeCacheConfig`, `st` its `specache.State`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specache_jax.caches import attention as A
from specache_jax.caches import selection


def membership(pos_BKY, set_BKX):
  """[B, K, Y] bool: pos in set (entries of set < 0 are empty)."""
  return jnp.any(pos_BKY[..., None] == set_BKX[:, :, None, :], axis=-1)


def hit_stats(method, st, q, lengths, kappa_used):
  """With track_hits (simulated mode only): how well κ_t served the real row, from its exact attention over the
  16-bit keys (group-averaged probabilities p over the stored positions). Per row [B], averaged over KV heads:

    topk_hits        |κ_t ∩ exact top-k| / min(k, n)
    unfetched_mass   Σ p over the positions this attend read low-bit (below the ring's 16-bit keys, not in κ_t)
    drift            1 - cos(real query, the speculative query that chose κ_t) (`query_drift`)
  each also as *_on_miss (times `st.miss`: steps whose speculative token was wrong), with the counters
  topk_count (1 per row-step) and miss_count."""
  if not method.track_hits or method.offload:
    return {}
  b, _, n_heads, h = q.shape
  n_kv = st.k16.shape[1]
  q0 = A.split_heads(q[:, :1], n_kv)                                       # [B, 1, K, G, H]
  s = st.k16.shape[2]
  mask = jnp.broadcast_to(A.valid_cols_mask(lengths, s, 1), (b, n_kv, 1, s))
  p = jnp.mean(jax.nn.softmax(A.segment_logits(q0, st.k16, mask, h ** -0.5), axis=-1)[:, :, :, 0, :], axis=2)
  # the target: the real row's exact top-k over every stored position, whatever the method's candidates
  # (skip_ring's included); slots past a row's length only fill it when n < k and never match a valid κ entry
  stored = jnp.arange(s)[None, None, :] < lengths[:, None, None]
  exact = selection.top_k_indices(jnp.where(stored, p, -1.0), method.topk)          # [B, K, X]
  valid = kappa_used < lengths[:, None, None]
  hits = jnp.sum(membership(jnp.where(valid, kappa_used, -3), exact), axis=-1)  # [B, K]
  denom = jnp.minimum(method.topk, lengths)[:, None].astype(jnp.float32)
  low_below = method.sixteen_bit_from(lengths)
  fetched = jax.vmap(jax.vmap(lambda i: jnp.zeros((s + 1,), bool).at[i].set(True)))(
      jnp.where(valid & (kappa_used >= 0), kappa_used, s))[..., :s]         # [B, K, S]
  low = (jnp.arange(s)[None, None, :] < low_below[:, None, None]) & ~fetched
  stats = {"topk_hits": jnp.mean(hits / jnp.maximum(denom, 1.0), axis=1),
           "unfetched_mass": jnp.mean(jnp.sum(jnp.where(low, p, 0.0), axis=-1), axis=1)}
  if st.spec_q.shape[-1]:                                                  # kept: speculative
    stats["drift"] = jnp.mean(query_drift(st, q), axis=1)
  miss = st.miss.astype(jnp.float32)
  stats.update({f"{k}_on_miss": v * miss for k, v in list(stats.items())})
  return dict(stats, topk_count=jnp.ones((b,)), miss_count=miss)


def query_drift(st, q):
  """[B, K] float32: 1 - cosine between the real row's query (row 0 of q [B,T,N,H]) and the speculative query
  that chose κ_t (`st.spec_q`, same position, so RoPE does not change it), averaged over each KV head's group;
  with several candidates, the nearest one's (the largest mean cosine)."""
  b, n_kv = st.kappa.shape[:2]
  real = A.split_heads(q[:, :1], n_kv)[:, 0].astype(jnp.float32)           # [B, K, G, H]
  g = real.shape[2]
  spec = st.spec_q.reshape(b, n_kv, -1, g, real.shape[-1])                 # [B, K, C, G, H]
  real = real[:, :, None]
  cos = jnp.sum(real * spec, -1) / jnp.maximum(jnp.linalg.norm(real, axis=-1) * jnp.linalg.norm(spec, axis=-1),
                                               jnp.finfo(jnp.float32).tiny)
  return jnp.maximum(1.0 - jnp.max(jnp.mean(cos, axis=-1), axis=-1), 0.0)  # rounding: never below 0
