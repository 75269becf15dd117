"""Decode attention over a dense float32 KV cache on XLA:CPU (`dense_attention.cc`): the full cache's decoding
step as one custom call per layer.

XLA's form (`caches.attention.segmented_attention`: a batched dot for the logits, a softmax, a second dot for the
values) reads the whole [B, K, S, H] buffer — slots past the lengths too — and runs its small-M dots at ~8 GB/s
(S=8192, K=3, G=3, float32: ~1 ms per layer for 12.6 MB on the 2-core AVX-512 CPU, in a step whose weights stream
at ~28 GB/s). The kernel streams each key and value row once for every query row of its KV head, in chunks of
slots spread over the threads with an online softmax, and reads only the slots some row attends.

`supports(...)`: float32 cache, head_dim a multiple of 16 up to 128, at most 64 query rows per KV head (G·T).
`caches/full.py` takes it on the CPU backend where it `applies`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import cpu_kernels as ck

MAX_ROWS = 64            # G·T query rows per KV head (the kernel's kMaxRows)


def supports(dtype, head_dim: int, rows: int) -> bool:
  """A float32 cache, head_dim a multiple of 16 (<= 128), 1 <= G·T <= MAX_ROWS."""
  return jnp.dtype(dtype) == jnp.float32 and head_dim % 16 == 0 and 16 <= head_dim <= 128 and 1 <= rows <= MAX_ROWS


def applies(dtype, head_dim: int, rows: int) -> bool:
  """Whether `specache_jax.dispatch` may take the kernel: a layout it `supports` and the kernels built."""
  return supports(dtype, head_dim, rows) and ck.available()


def _check(q, k, v, limit) -> None:
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"decode_attention: q [B,T,N,H], k and v [B,K,S,H]; got q {q.shape}, k {k.shape}, "
                     f"v {v.shape}")
  if k.shape[1] < 1 or q.shape[2] % k.shape[1]:
    raise ValueError(f"decode_attention: N={q.shape[2]} query heads must be a multiple of K={k.shape[1]}")
  if limit.shape != (q.shape[0],):
    raise ValueError(f"decode_attention: limit must be [B={q.shape[0]}]; got {limit.shape}")
  rows = q.shape[2] // k.shape[1] * q.shape[1]
  if not supports(k.dtype, q.shape[3], rows):
    raise ValueError(f"decode_attention: cache {k.dtype}, head_dim={q.shape[3]}, {rows} query rows per KV head: "
                     f"the CPU kernel takes float32, head_dim a multiple of 16 up to 128, at most {MAX_ROWS} rows")


def decode_attention(q_BTNH, k_BKSH, v_BKSH, limit_B, sm_scale: float):
  """out [B, T, N, H] (q's dtype): query row t of sequence b attends to slots s < limit[b] + t of the cache
  (a row that sees no slot gives zeros). float32 inside. CPU backend only."""
  _check(q_BTNH, k_BKSH, v_BKSH, limit_B)
  if not ck.available():
    raise RuntimeError(f"decode_attention: CPU kernels {ck.status()}")
  b, t, n, h = q_BTNH.shape
  kh = k_BKSH.shape[1]
  f32 = jnp.float32
  q_rows = jnp.transpose((q_BTNH.astype(f32) * f32(sm_scale)).reshape(b, t, kh, n // kh, h), (0, 2, 3, 1, 4))
  out = _partitioned(t)(q_rows.reshape(b, kh, -1, h), k_BKSH, v_BKSH, limit_B.astype(jnp.int32))
  out = jnp.transpose(out.reshape(b, kh, n // kh, t, h), (0, 3, 1, 2, 4)).reshape(b, t, n, h)
  return out.astype(q_BTNH.dtype)


def decode_attention_reference(q_BTNH, k_BKSH, v_BKSH, limit_B, sm_scale: float):
  """`decode_attention` in dense float32 jnp (the same signature)."""
  _check(q_BTNH, k_BKSH, v_BKSH, limit_B)
  b, t, n, h = q_BTNH.shape
  kh, s = k_BKSH.shape[1], k_BKSH.shape[2]
  hp = jax.lax.Precision.HIGHEST
  q = q_BTNH.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,bksh->bkgts", q, k_BKSH.astype(jnp.float32), precision=hp) * sm_scale
  ok = jnp.arange(s)[None, None, :] < (limit_B[:, None, None] + jnp.arange(t)[None, :, None])   # [B, T, S]
  logits = jnp.where(ok[:, None, None], logits, -jnp.inf)
  p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  p = jnp.where(ok[:, None, None], p, 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), np.finfo(np.float32).tiny)
  out = jnp.einsum("bkgts,bksh->btkgh", p, v_BKSH.astype(jnp.float32), precision=hp)
  return out.reshape(b, t, n, h).astype(q_BTNH.dtype)


def _call(t: int, q_rows, k, v, limit):
  out = jax.ShapeDtypeStruct(q_rows.shape, jnp.float32)
  return jax.ffi.ffi_call(ck.DENSE_TARGET, out, vmap_method="sequential")(q_rows, k, v, limit, t_rows=t)


@functools.cache
def _partitioned(t: int):
  """The custom call for the SPMD partitioner: the batch axis keeps its sharding (`cpu_kernels.batch_partitioned`)."""
  return ck.batch_partitioned(functools.partial(_call, t), "b k m h, b k s h, b k s h, b -> b k m h", 1,
                              ("k", "m", "h", "s"))
