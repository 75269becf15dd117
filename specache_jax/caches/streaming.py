"""StreamingLLM: keep the first `sink` tokens (attention sinks) and the newest `budget - sink`; evict the rest.

Slot layout (per batch row, shared by all KV heads), W = budget - sink:
  slots [0, sink)       hold positions 0 .. sink-1 (never evicted);
  slots [sink, budget)  are a ring: position p >= sink lives in slot sink + (p - sink) % W, so writing the
                        newest token overwrites the oldest one of the window.
`pos [B, budget]` records the position held by each slot (-1 empty); it follows from the ring arithmetic and
`lengths`, and is kept explicitly so masks and tests read it directly.

Project choice: keys are stored after RoPE at their original positions, and new tokens keep their true
positions (`lengths + t`); there is no re-indexing of positions inside the cache (StreamingLLM's paper
re-rotates keys to their in-cache positions; this baseline does not).
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
class StreamingConfig(CacheConfig):
  name = "streaming"
  budget: int = 256             # slots kept per layer and batch row: sinks + recent window
  sink: int = 4                 # first tokens always kept (attention sinks)

  def __post_init__(self):
    check_int("budget", self.budget, 1)
    check_int("sink", self.sink, 0)
    if self.budget <= self.sink:
      raise ConfigError(f"budget={self.budget} must be larger than sink={self.sink} "
                        "(the recent window budget - sink would be empty)")

  @property
  def impl(self):
    return sys.modules[__name__]

  @property
  def window(self) -> int:
    return self.budget - self.sink


@struct.dataclass
class State:
  k: jax.Array     # [B, K, budget, H] post-RoPE keys
  v: jax.Array     # [B, K, budget, H]
  pos: jax.Array   # [B, budget] int32 position held by each slot, -1 empty


def init(method: StreamingConfig, model_cfg, batch: int, max_len: int, dtype) -> State:
  del max_len
  shape = (batch, model_cfg.n_kv_heads, method.budget, model_cfg.head_dim)
  return stack_layers(model_cfg.n_layers, State(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                                                pos=jnp.full((batch, method.budget), -1, jnp.int32)))


def slot_of(method: StreamingConfig, pos_B):
  """The slot [B] that holds position pos[B]."""
  return jnp.where(pos_B < method.sink, pos_B, method.sink + jnp.mod(pos_B - method.sink, method.window))


def kept_positions(method: StreamingConfig, lengths_B):
  """pos [B, budget]: the position each slot holds once `lengths` tokens went through the cache (-1 empty)."""
  j = jnp.arange(method.budget, dtype=jnp.int32)[None, :]                # [1, budget]
  last = lengths_B.astype(jnp.int32)[:, None] - 1                         # [B, 1]
  ring = last - jnp.mod(last - j, method.window)                         # latest p <= last with slot_of(p) == j
  pos = jnp.where(j < method.sink, jnp.broadcast_to(j, ring.shape), ring)
  held = jnp.where(j < method.sink, pos <= last, pos >= method.sink)
  return jnp.where(held, pos, -1)


def prefill(method: StreamingConfig, st: State, k, v, lengths, colsum=None) -> State:
  """Store the sinks and the last window of each right-padded prompt (k, v [B, T, K, H], lengths [B])."""
  del colsum
  pos = kept_positions(method, lengths)                                   # [B, budget]
  n_kv = k.shape[2]
  idx = jnp.broadcast_to(pos[:, None, :], (pos.shape[0], n_kv, method.budget))
  held = (idx >= 0)[..., None]                                            # [B, K, budget, 1]
  keys = jnp.where(held, A.gather_rows(jnp.swapaxes(k, 1, 2), idx), 0)    # [B, K, budget, H]
  values = jnp.where(held, A.gather_rows(jnp.swapaxes(v, 1, 2), idx), 0)
  return State(k=keys.astype(st.k.dtype), v=values.astype(st.v.dtype), pos=pos)


def attend(method: StreamingConfig, st: State, q, k_new, v_new, lengths):
  """The T new rows (q [B,T,N,H], k/v_new [B,T,K,H]) see the kept slots and each other causally; then each
  new row t is written at position lengths + t, overwriting the oldest window slot once the ring is full."""
  b, t, _, _ = q.shape
  n_kv = k_new.shape[2]
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)          # [B, K, T, H]
  kept = jnp.broadcast_to((st.pos >= 0)[:, None, None, :], (b, 1, t, method.budget))
  out, _ = A.segmented_attention(q, [(st.k, st.v, kept), (kn, vn, A.causal_new_mask(b, t))],
                                 q.shape[-1] ** -0.5, n_kv)
  keys, values, pos = st.k, st.v, st.pos
  for i in range(t):
    p = lengths.astype(jnp.int32) + i                                     # [B]
    slot = slot_of(method, p)
    keys = A.write_rows(keys, kn[:, :, i:i + 1], slot)
    values = A.write_rows(values, vn[:, :, i:i + 1], slot)
    pos = jnp.where(jnp.arange(method.budget)[None, :] == slot[:, None], p[:, None], pos)
  return out, State(k=keys, v=values, pos=pos), {}


def device_bytes(method, st: State) -> int:
  return tree_nbytes(st)
