"""The 16-bit full cache: the baseline every other method is measured against."""
from __future__ import annotations

import dataclasses
import sys

import jax.numpy as jnp
from flax import struct

from specache_jax import dispatch
from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches.base import CacheConfig, stack_layers


@dataclasses.dataclass(frozen=True)
class FullConfig(CacheConfig):
  name = "full"

  @property
  def impl(self):
    return sys.modules[__name__]


@struct.dataclass
class State:
  k: jnp.ndarray   # [B, K, S, H]
  v: jnp.ndarray   # [B, K, S, H]


def init(method: FullConfig, model_cfg, batch: int, max_len: int, dtype) -> State:
  shape = (batch, model_cfg.n_kv_heads, method.slots(max_len), model_cfg.head_dim)
  return stack_layers(model_cfg.n_layers, State(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))


def prefill(method, st: State, k, v, lengths, colsum=None) -> State:
  del method, colsum
  start = jnp.zeros_like(lengths)
  return State(k=A.write_rows(st.k, jnp.swapaxes(k, 1, 2), start),
               v=A.write_rows(st.v, jnp.swapaxes(v, 1, 2), start))


def attend(method, st: State, q, k_new, v_new, lengths):
  """Every cached slot < lengths plus the new rows (causal); all T new rows are stored.

  The new rows are written first and attention reads the updated buffers (row i sees slots < lengths + i + 1):
  one writer then one reader, so the write is in place (a read of the old buffer beside an independent write
  would make XLA copy the whole cache). On XLA:CPU the attention is one kernel call (`cpu_kernels.dense_attention`:
  it reads only the slots below the lengths) where it applies (`dispatch.dense_attention`)."""
  del method
  _, t, n, h = q.shape
  n_kv, s = st.k.shape[1], st.k.shape[2]
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)           # [B, K, T, H]
  st = State(k=A.write_rows(st.k, kn, lengths), v=A.write_rows(st.v, vn, lengths))
  sm_scale = h ** -0.5

  def xla(q, k, v, lengths):
    cols_S = jnp.arange(s)[None, None, :]
    mask_BTS = cols_S < (lengths[:, None, None] + jnp.arange(1, t + 1)[None, :, None])
    return A.segmented_attention(q, [(k, v, mask_BTS[:, None])], sm_scale, n_kv)[0]

  out = dispatch.dense_attention("auto", xla, q, st.k, st.v, lengths, sm_scale)
  return out, st, {}


def device_bytes(method, st: State) -> int:
  return tree_nbytes(st)
