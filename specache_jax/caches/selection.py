"""SpeCache's κ choice: which stored positions' 16-bit rows the next attend reads, from an attention's
probabilities (`Scores`, the form the fused kernels return them in) — the top-k (`select`, `select_row`) with
the anchored rows first (`anchored`) — and the exact top-k they use (`top_k_indices`). `method` is a
`specache.SpeCacheConfig`."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specache_jax import dispatch
from specache_jax.cpu_kernels import select as cpu_select


def candidates(method, n_B):
  """How many leading positions κ may pick for an attend after n_B stored tokens: all n, or with skip_ring only
  those below the ring's 16-bit columns (`SpeCacheConfig.sixteen_bit_from`), which that attend never reads from κ."""
  return method.sixteen_bit_from(n_B) if method.speculation.skip_ring else n_B


def select(method, probs_BKS, n_B):
  """κ for an attend after n_B stored tokens: top-k positions of the group-averaged probabilities among the
  `candidates`."""
  return top_k_indices(_candidate_scores(method, probs_BKS, n_B), method.topk)


class Scores(NamedTuple):
  """An attention's probabilities per position as the fused kernels return them, in two parts: low [B, K, R, S]
  over the low-bit positions (0 where not attended) and extra [B, K, R, E] over the 16-bit columns (the ring, κ,
  the new rows), whose positions are extra_pos [B, K, E] (S where a column holds no stored position)."""
  low: jax.Array
  extra: jax.Array
  extra_pos: jax.Array

  def dense(self):
    """[B, K, R, S] float32: the extra columns' probabilities added at their positions."""
    pos = jnp.broadcast_to(self.extra_pos[:, :, None], self.extra.shape)
    return cpu_select.scatter_add(self.low, self.extra, pos)


ANCHOR_BOOST = 2.0   # added to an anchored position's score: above any probability (at most 1) plus itself
ANCHOR_WINDOW = 32   # positions around one anchor, half of them before it: the copied phrase's context and continuation


def anchored(scores: Scores, anchors_BA, rows: int, low_below_B, window: int = ANCHOR_WINDOW) -> Scores:
  """`scores` with at most `rows` positions around the anchors [B, A] (`history.anchors`; negative: none)
  raised by ANCHOR_BOOST in every row, as extra columns, so a top-k takes them before any scored position. Each
  anchor has a `window` of positions, half before it; of those the attend reads only in low bits (below
  low_below_B [B], `SpeCacheConfig.sixteen_bit_from`), the `rows` nearest to their anchor are taken (ties: the earlier
  anchor first). One anchor gets its window, several share the `rows` (windows may overlap)."""
  b, k, r, _ = scores.extra.shape
  s = scores.low.shape[-1]
  a = anchors_BA.shape[1]
  if rows == 0 or a == 0:
    return scores
  offset_W = jnp.arange(window, dtype=jnp.int32) - window // 2
  pos_BAW = anchors_BA[:, :, None] + offset_W[None, None, :]
  valid_BAW = ((anchors_BA[:, :, None] >= 0) & (pos_BAW >= 0)
               & (pos_BAW < jnp.minimum(low_below_B, s)[:, None, None]))
  rank_AW = jnp.abs(offset_W)[None, :] * a + jnp.arange(a, dtype=jnp.int32)[:, None]     # nearer, then earlier
  none = -window * a - 1
  priority_BX = jnp.where(valid_BAW, -rank_AW[None], none).reshape(b, a * window)
  best_BX, at_BX = jax.lax.top_k(priority_BX, min(rows, a * window))      # the first positions
  pos_BX = jnp.take_along_axis(pos_BAW.reshape(b, a * window), at_BX, axis=1)
  pos_BX = jnp.where(best_BX > none, pos_BX, s)                           # s: adds nothing
  e = pos_BX.shape[1]
  pos_BKE = jnp.broadcast_to(pos_BX[:, None, :], (b, k, e))
  boost = jnp.full((b, k, r, e), ANCHOR_BOOST, scores.extra.dtype)
  return Scores(low=scores.low, extra=jnp.concatenate([scores.extra, boost], axis=-1),
                extra_pos=jnp.concatenate([scores.extra_pos, pos_BKE.astype(scores.extra_pos.dtype)], axis=-1))


def select_row(method, scores: Scores, row: int, n_B):
  """`select` from row `row` of `scores`, i.e. select(method, scores.dense()[:, :, row], n_B), exactly; on XLA:CPU
  the scatter, the candidate mask and the top-k are one custom call (`cpu_select.scatter_top_k`)."""
  low, extra = scores.low[:, :, row], scores.extra[:, :, row]
  limit = jnp.broadcast_to(candidates(method, n_B)[:, None], low.shape[:2]).astype(jnp.int32)
  k = method.topk
  reference = lambda *a: top_k_indices(cpu_select.scatter_scores(*a), k)      # noqa: E731
  if TOPK_BLOCK is not None:
    return reference(low, extra, scores.extra_pos, limit)
  return dispatch.scatter_top_k(method.attention_impl, reference, low, extra, scores.extra_pos, limit, k)


def _candidate_scores(method, probs_BKS, n_B):
  ok = jnp.arange(probs_BKS.shape[-1])[None, None, :] < candidates(method, n_B)[:, None, None]
  return jnp.where(ok, probs_BKS, -1.0)


# Slots per block of `top_k_indices` in `select`; None = one top-k (on XLA:CPU, `cpu_kernels.select`'s kernel).
# Measured on XLA:CPU (results/topk_cpu.md, before that kernel): its TopK was already faster than any blocked
# variant (k=64, S=8192: 0.11 ms vs 0.15-0.76 ms), so the default is None. XLA:GPU's fast TopK targets small k
# and may sort the whole axis at k=64: the GPU check measures the blocked form there.
TOPK_BLOCK = None


def top_k_indices(scores_BKS, k: int, block: int | None = TOPK_BLOCK):
  """int32 indices of `lax.top_k(scores, k)` along the last axis, exactly (ties: the lower index first, as
  lax.top_k), computed as the top-k of every block of `block` slots, then the top-k of those candidates.

  Exact because each of the k largest is among its own block's k largest; ties agree because candidates are
  laid out block by block, each block's in lax.top_k's order. For S > block it reads S scores once and sorts
  only k·S/block candidates. One lax.top_k when block is None, S <= block or block < k."""
  s = scores_BKS.shape[-1]
  if block is None or block < k or s <= block:
    return dispatch.top_k(scores_BKS, k)                                         # XLA:CPU: select.cc
  n_blocks = -(-s // block)
  lead = scores_BKS.shape[:-1]
  padded = jnp.pad(scores_BKS, [(0, 0)] * len(lead) + [(0, n_blocks * block - s)], constant_values=-jnp.inf)
  vals, idx = jax.lax.top_k(padded.reshape(lead + (n_blocks, block)), k)          # [..., n_blocks, k]
  idx = idx + (jnp.arange(n_blocks, dtype=idx.dtype) * block).reshape((1,) * len(lead) + (n_blocks, 1))
  _, pick = jax.lax.top_k(vals.reshape(lead + (n_blocks * k,)), k)
  return jnp.take_along_axis(idx.reshape(lead + (n_blocks * k,)), pick, axis=-1).astype(jnp.int32)
