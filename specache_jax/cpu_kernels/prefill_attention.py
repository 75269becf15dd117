"""Causal prefill attention on XLA:CPU (`prefill_attention.cc`): `caches.attention.prefill_attention`'s contract
without the column sums, as one custom call.

The blockwise jnp form (flash-style online softmax over key blocks in a `fori_loop`) ran at ~110 GFLOP/s at
8k tokens and ~50 at 1k (SmolLM2-135M's 9 query / 3 KV heads, head_dim 64, the 2-core AVX-512 CPU, where a GEMM
of the prompt's projections reaches ~270): two thirds of an 8k prefill's time. The kernel tiles the same
computation in registers (6 rows x 64 columns of logits from the transposed keys, 6 rows x 64 channels of the
output) and keeps a key block in L2 while every row of a 64-position block uses it.

`supports(head_dim)`: head_dim a multiple of 64. Callers take it on the CPU backend where it `applies`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import cpu_kernels as ck

KEY_BLOCK = 256          # the kernel's kBk: keys and values are padded to a multiple of it


def supports(head_dim: int) -> bool:
  return head_dim >= 64 and head_dim % 64 == 0


def applies(head_dim: int) -> bool:
  """Whether `specache_jax.dispatch` may take the kernel: a head_dim it `supports` and the kernels built."""
  return supports(head_dim) and ck.available()


def _check(q, k, v, lengths) -> None:
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
    raise ValueError(f"causal_attention: q [B,T,N,H], k and v [B,T,K,H]; got q {q.shape}, k {k.shape}, v {v.shape}")
  if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
    raise ValueError(f"causal_attention: N={q.shape[2]} query heads must be a multiple of K={k.shape[2]}")
  if lengths.shape != (q.shape[0],):
    raise ValueError(f"causal_attention: lengths must be [B={q.shape[0]}]; got {lengths.shape}")
  if not supports(q.shape[3]):
    raise ValueError(f"causal_attention: head_dim={q.shape[3]} must be a multiple of 64 for the CPU kernel")


def causal_attention(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale: float):
  """out [B, T, N, H] (q's dtype): row t of prompt b attends to keys j <= min(t, lengths[b] - 1) (rows past the
  length attend to the whole prompt; a length of 0 gives zeros). float32 inside. CPU backend only."""
  _check(q_BTNH, k_BTKH, v_BTKH, lengths_B)
  if not ck.available():
    raise RuntimeError(f"causal_attention: CPU kernels {ck.status()}")
  t = q_BTNH.shape[1]
  pad = -(-max(t, 1) // KEY_BLOCK) * KEY_BLOCK - t
  f32 = jnp.float32
  b, _, kh, h = k_BTKH.shape
  k = jnp.pad(k_BTKH.astype(f32), ((0, 0), (0, pad), (0, 0), (0, 0)))                  # [B, Tp, K, H]
  kt = jnp.transpose(k.reshape(b, -1, KEY_BLOCK, kh, h), (0, 3, 1, 4, 2))               # [B, K, Tp/kBk, H, kBk]
  out = _partitioned(float(sm_scale))(q_BTNH.astype(f32), kt, v_BTKH.astype(f32), lengths_B.astype(jnp.int32))
  return out.astype(q_BTNH.dtype)


def causal_attention_reference(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale: float):
  """`causal_attention` in dense float32 jnp (the same signature)."""
  _check(q_BTNH, k_BTKH, v_BTKH, lengths_B)
  b, t, n, h = q_BTNH.shape
  kh = k_BTKH.shape[2]
  hp = jax.lax.Precision.HIGHEST
  q = q_BTNH.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BTKH.astype(jnp.float32), precision=hp) * sm_scale
  pos = jnp.arange(t)
  limit = jnp.minimum(pos[None, :], lengths_B[:, None] - 1)                 # [B, T]
  ok = pos[None, None, :] <= limit[:, :, None]                              # [B, T, S]
  logits = jnp.where(ok[:, None, None], logits, -jnp.inf)
  p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  p = jnp.where(ok[:, None, None], p, 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), np.finfo(np.float32).tiny)
  out = jnp.einsum("bkgts,bskh->btkgh", p, v_BTKH.astype(jnp.float32), precision=hp)
  return out.reshape(b, t, n, h).astype(q_BTNH.dtype)


def _call(sm_scale: float, q, kt, v, lengths):
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  return jax.ffi.ffi_call(ck.PREFILL_TARGET, out, vmap_method="sequential")(q, kt, v, lengths,
                                                                           sm_scale=np.float32(sm_scale))


@functools.cache
def _partitioned(sm_scale: float):
  return ck.batch_partitioned(functools.partial(_call, sm_scale), "b t n h, b k c h j, b t k h, b -> b t n h", 1,
                              ("t", "n", "h", "k", "c", "j"))
