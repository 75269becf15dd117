"""H2O (Heavy-Hitter Oracle): keep the `recent` newest tokens plus the heavy hitters, per KV head.

Score of a cached token = the attention it has received so far, summed over every query row that saw it
(the prompt's rows in prefill, each decoded row after) and averaged over the G query heads of its KV group.
This is the variant of the official code's real-drop cache (`H2OKVCache_LayerWise`, FMInference/H2O): scores
accumulate over the whole generation (not a sliding average), each query's probabilities are those over the
tokens it actually saw (the kept ones), and a new token's score starts with the attention the new rows pay it.
  prefill: positions >= length - recent are kept; of the older ones, the `heavy = budget - recent` with the
           largest column sums (`colsum [B, K, T]`, from the decoder) are kept.
  decode:  the new rows attend to the kept slots + each other (causal); their probabilities are added to the
           scores; each new token is then inserted in turn: into an empty slot if there is one, else over the
           lowest-score slot outside the recent window (positions > p - recent, p the new token's position).
The official code appends and then keeps the top `heavy` of the non-recent tokens; for one new token that is
the same as evicting the lowest non-recent score. Ties go to the lower slot index (argmin/top_k order).
Keys stay post-RoPE at their original positions (no re-indexing, as in the official real-drop code).
The state holds `budget` slots whatever `max_len` is. Axis letters as in caches/attention.py.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches.base import CacheConfig, check_int, stack_layers
from specache_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class H2OConfig(CacheConfig):
  name = "h2o"
  needs_attention_colsum = True
  budget: int = 256             # slots kept per layer, batch row and KV head: heavy hitters + recent
  recent: int | None = None     # newest tokens always kept; None: max(1, budget // 2)

  def __post_init__(self):
    check_int("budget", self.budget, 1)
    if self.recent is not None:
      check_int("recent", self.recent, 1)
      if self.recent > self.budget:
        raise ConfigError(f"recent={self.recent} must be <= budget={self.budget}")

  @property
  def impl(self):
    return sys.modules[__name__]

  @property
  def recent_tokens(self) -> int:
    return self.recent if self.recent is not None else max(1, self.budget // 2)

  @property
  def heavy(self) -> int:
    return self.budget - self.recent_tokens


@struct.dataclass
class State:
  k: jax.Array       # [B, K, budget, H] post-RoPE keys
  v: jax.Array       # [B, K, budget, H]
  pos: jax.Array     # [B, K, budget] int32 position held by each slot, -1 empty
  score: jax.Array   # [B, K, budget] float32 accumulated attention received (0 for empty slots)


def init(method: H2OConfig, model_cfg, batch: int, max_len: int, dtype) -> State:
  del max_len
  shape = (batch, model_cfg.n_kv_heads, method.budget)
  kv = shape + (model_cfg.head_dim,)
  return stack_layers(model_cfg.n_layers, State(
      k=jnp.zeros(kv, dtype), v=jnp.zeros(kv, dtype), pos=jnp.full(shape, -1, jnp.int32),
      score=jnp.zeros(shape, jnp.float32)))


def prefill(method: H2OConfig, st: State, k, v, lengths, colsum=None) -> State:
  """Keep the last `recent` prompt tokens and the top-`heavy` older ones by colsum, per KV head.

  k, v [B, T, K, H]; lengths [B]; colsum [B, K, T] float32 (attention received, averaged over the group)."""
  if colsum is None:
    raise ValueError("h2o.prefill needs the prompt's attention column sums (colsum [B, K, T])")
  b, t, n_kv, _ = k.shape
  p = jnp.arange(t, dtype=jnp.int32)[None, None, :]                       # [1, 1, T]
  length = lengths.astype(jnp.int32)[:, None, None]                       # [B, 1, 1]
  valid = p < length
  recent = valid & (p >= length - method.recent_tokens)
  priority = jnp.where(recent, jnp.inf, jnp.where(valid, colsum.astype(jnp.float32), -jnp.inf))
  if t < method.budget:
    priority = jnp.pad(priority, ((0, 0), (0, 0), (0, method.budget - t)), constant_values=-jnp.inf)
  top, idx = jax.lax.top_k(priority, method.budget)                       # [B, K, budget]
  order = jnp.sort(jnp.where(top > -jnp.inf, idx, jnp.iinfo(jnp.int32).max), axis=-1)
  pos = jnp.where(order < jnp.iinfo(jnp.int32).max, order, -1).astype(jnp.int32)   # ascending, empties last
  held = pos >= 0
  keys = jnp.where(held[..., None], A.gather_rows(jnp.swapaxes(k, 1, 2), pos), 0)  # [B, K, budget, H]
  values = jnp.where(held[..., None], A.gather_rows(jnp.swapaxes(v, 1, 2), pos), 0)
  score = jnp.where(held, jnp.take_along_axis(colsum.astype(jnp.float32), jnp.clip(pos, 0, t - 1), axis=-1),
                    0.0)
  return State(k=keys.astype(st.k.dtype), v=values.astype(st.v.dtype), pos=pos, score=score)


def evict_slot(method: H2OConfig, pos_BKS, score_BKS, p_B):
  """The slot [B, K] a token at position p takes: the first empty slot, else the lowest-score slot whose
  token is outside the recent window (position <= p - recent)."""
  p = p_B.astype(jnp.int32)[:, None, None]                                # [B, 1, 1]
  protected = pos_BKS > p - method.recent_tokens
  priority = jnp.where(pos_BKS < 0, -jnp.inf, jnp.where(protected, jnp.inf, score_BKS))
  return jnp.argmin(priority, axis=-1).astype(jnp.int32)


def attend(method: H2OConfig, st: State, q, k_new, v_new, lengths):
  """q [B,T,N,H], k/v_new [B,T,K,H]: attention over the kept slots + new rows, scores updated, then each new
  row t (position lengths + t) inserted with eviction."""
  b, t, n, _ = q.shape
  n_kv = k_new.shape[2]
  g = n // n_kv
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)          # [B, K, T, H]
  kept = jnp.broadcast_to((st.pos >= 0)[:, :, None, :], (b, n_kv, t, method.budget))
  out, (p_cached, p_new) = A.segmented_attention(
      q, [(st.k, st.v, kept), (kn, vn, A.causal_new_mask(b, t))], q.shape[-1] ** -0.5, n_kv)
  score = st.score + jnp.einsum("bkgts->bks", p_cached) / g               # [B, K, budget]
  new_score = jnp.einsum("bkgts->bks", p_new) / g                         # [B, K, T]
  keys, values, pos = st.k, st.v, st.pos
  bi = jnp.arange(b)[:, None]                                             # [B, 1]
  ki = jnp.arange(n_kv)[None, :]                                          # [1, K]
  for i in range(t):
    p = lengths.astype(jnp.int32) + i                                     # [B]
    slot = evict_slot(method, pos, score, p)                              # [B, K]
    keys = keys.at[bi, ki, slot].set(kn[:, :, i].astype(keys.dtype))
    values = values.at[bi, ki, slot].set(vn[:, :, i].astype(values.dtype))
    pos = pos.at[bi, ki, slot].set(jnp.broadcast_to(p[:, None], (b, n_kv)))
    score = score.at[bi, ki, slot].set(new_score[:, :, i])
  return out, State(k=keys, v=values, pos=pos, score=score), {}


def device_bytes(method, st: State) -> int:
  return tree_nbytes(st)
