"""SpeCache's κ choice, the κ rows' gather and the greedy token on XLA:CPU (`select.cc`), each beside its jnp
reference.

At 8k slots XLA:CPU spent ~0.11 ms per layer in its TopK (k=64 of [3, 8448], a partial_sort of every index
through an indirect comparator) and ~0.05 ms per gather of 64 rows per head from the simulated 16-bit cache
(an index computed per element): ~6 ms of a ~45 ms SmolLM2-135M SpeCache step. The kernels pick the same indices
(`top_k_indices`: lax.top_k's order, ties to the lower index, NaNs and signed zeros in XLA's total order) and
copy whole rows (`take_rows`). The greedy token's argmax over SmolLM2's 49152 logits took XLA:CPU's variadic
reduce ~85 µs per row (two rows per sequence and step for SpeCache); `argmax` reads the row twice at memory speed.

Callers (`caches/selection.py`, `caches/attention.py`, `decode.py`) take them on the CPU backend where they
`apply` and lower to the references for every other platform (`lax.platform_dependent`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from specache_jax import cpu_kernels as ck


def applies() -> bool:
  """Whether `specache_jax.dispatch` may take the kernels: they are built."""
  return ck.available()


def _check_top_k(scores, k: int) -> None:
  if scores.ndim < 1 or scores.dtype != jnp.float32:
    raise ValueError(f"top_k_indices: scores must be float32 [..., S]; got {scores.dtype} {scores.shape}")
  if not 0 <= k <= scores.shape[-1]:
    raise ValueError(f"top_k_indices: k={k} must be in [0, S={scores.shape[-1]}]")


def top_k_indices(scores, k: int):
  """int32 indices [..., k] of `lax.top_k(scores, k)` (float32 scores [..., S]), exactly. CPU backend only."""
  _check_top_k(scores, k)
  if not ck.available():
    raise RuntimeError(f"top_k_indices: CPU kernels {ck.status()}")
  lead, s = scores.shape[:-1], scores.shape[-1]
  n = math.prod(lead)
  if n == 0 or k == 0:
    return jnp.zeros(lead + (k,), jnp.int32)
  out = _top_k_partitioned(k)(scores.reshape(n, s))
  return out.reshape(lead + (k,))


def top_k_indices_reference(scores, k: int):
  """`top_k_indices` in jnp (the same signature)."""
  _check_top_k(scores, k)
  return jax.lax.top_k(scores, k)[1].astype(jnp.int32)


def _check_scatter_top_k(low, extra, pos, limit, k: int) -> None:
  lead, s = low.shape[:-1], low.shape[-1]
  if (low.ndim < 1 or low.dtype != jnp.float32 or extra.dtype != jnp.float32 or extra.shape[:-1] != lead
      or pos.shape != extra.shape or limit.shape != lead or not jnp.issubdtype(pos.dtype, jnp.integer)
      or not jnp.issubdtype(limit.dtype, jnp.integer)):
    raise ValueError(f"scatter_top_k: low float32 [..., S], extra float32 [..., E], integer pos [..., E] and limit "
                     f"[...] with the same leading axes; got low {low.dtype} {low.shape}, extra {extra.dtype} "
                     f"{extra.shape}, pos {pos.dtype} {pos.shape}, limit {limit.dtype} {limit.shape}")
  if not 0 <= k <= s:
    raise ValueError(f"scatter_top_k: k={k} must be in [0, S={s}]")


def scatter_top_k(low, extra, pos, limit, k: int):
  """int32 [..., k]: `top_k_indices` of the scores low [..., S] with extra [..., E] added at positions pos
  [..., E] (in order; positions outside [0, S) add nothing), -1 at positions >= limit [...]. SpeCache's κ from its
  attention's two probability parts in one custom call. CPU backend only."""
  _check_scatter_top_k(low, extra, pos, limit, k)
  if not ck.available():
    raise RuntimeError(f"scatter_top_k: CPU kernels {ck.status()}")
  lead, s, e = low.shape[:-1], low.shape[-1], extra.shape[-1]
  n = math.prod(lead)
  if n == 0 or k == 0:
    return jnp.zeros(lead + (k,), jnp.int32)
  out = _scatter_top_k_partitioned(k)(low.reshape(n, s), extra.reshape(n, e), pos.reshape(n, e).astype(jnp.int32),
                                      limit.reshape(n).astype(jnp.int32))
  return out.reshape(lead + (k,))


def scatter_add(low, extra, pos):
  """low [..., S] with extra [..., E] added at positions pos [..., E] (in order; outside [0, S): nothing)."""
  s = low.shape[-1]
  idx = jnp.where((pos >= 0) & (pos < s), pos, s)
  padded = jnp.concatenate([low, jnp.zeros(low.shape[:-1] + (1,), low.dtype)], -1)
  flat = padded.reshape(-1, s + 1)
  dense = jax.vmap(lambda p, i, v: p.at[i].add(v))(flat, idx.reshape(flat.shape[0], -1),
                                                   extra.reshape(flat.shape[0], -1))
  return dense.reshape(padded.shape)[..., :s]


def scatter_scores(low, extra, pos, limit):
  """`scatter_top_k`'s scores in jnp: [..., S] float32 (`scatter_add`, then -1 at positions >= limit)."""
  s = low.shape[-1]
  ok = jnp.arange(s).reshape((1,) * limit.ndim + (s,)) < limit[..., None]
  return jnp.where(ok, scatter_add(low, extra, pos), -1.0)


def scatter_top_k_reference(low, extra, pos, limit, k: int):
  """`scatter_top_k` in jnp (the same signature)."""
  _check_scatter_top_k(low, extra, pos, limit, k)
  return jax.lax.top_k(scatter_scores(low, extra, pos, limit), k)[1].astype(jnp.int32)


def _check_argmax(x) -> None:
  if x.ndim < 1 or x.dtype != jnp.float32 or x.shape[-1] == 0:
    raise ValueError(f"argmax: x must be float32 [..., V] with V >= 1; got {x.dtype} {x.shape}")


def argmax(x):
  """int32 [...]: `jnp.argmax(x, axis=-1)` of float32 x [..., V] exactly (the first NaN where a row has one, else
  the first maximum). CPU backend only."""
  _check_argmax(x)
  if not ck.available():
    raise RuntimeError(f"argmax: CPU kernels {ck.status()}")
  lead, v = x.shape[:-1], x.shape[-1]
  n = math.prod(lead)
  if n == 0:
    return jnp.zeros(lead, jnp.int32)
  return _argmax_partitioned()(x.reshape(n, v)).reshape(lead)


def argmax_reference(x):
  """`argmax` in jnp (the same signature)."""
  _check_argmax(x)
  return jnp.argmax(x, axis=-1).astype(jnp.int32)



def _check_take(buf, idx) -> None:
  if buf.ndim < 2 or idx.shape[:-1] != buf.shape[:-2] or not jnp.issubdtype(idx.dtype, jnp.integer):
    raise ValueError(f"take_rows: buf [..., S, R] and integer idx [..., X] with the same leading axes; got buf "
                     f"{buf.shape}, idx {idx.dtype} {idx.shape}")


def take_rows(buf, idx):
  """Rows of buf [..., S, R] at idx [..., X] (clipped into [0, S-1]) -> [..., X, R] of buf's dtype. CPU backend
  only."""
  _check_take(buf, idx)
  if not ck.available():
    raise RuntimeError(f"take_rows: CPU kernels {ck.status()}")
  *lead, s, r = buf.shape
  x = idx.shape[-1]
  n = math.prod(lead)
  if n * x * r == 0 or s == 0:
    return take_rows_reference(buf, idx)
  out = _take_partitioned()(buf.reshape(n, s, r), idx.reshape(n, x).astype(jnp.int32))
  return out.reshape(tuple(lead) + (x, r))


def take_rows_reference(buf, idx):
  """`take_rows` in jnp (the same signature)."""
  _check_take(buf, idx)
  i = jnp.clip(idx, 0, max(buf.shape[-2] - 1, 0))
  return jnp.take_along_axis(buf, i[..., None], axis=-2)


def _top_k_call(k: int, scores_NS):
  out = jax.ShapeDtypeStruct((scores_NS.shape[0], k), jnp.int32)
  return jax.ffi.ffi_call(ck.TOP_K_TARGET, out, vmap_method="sequential")(scores_NS)


def _scatter_top_k_call(k: int, low_NS, extra_NE, pos_NE, limit_N):
  out = jax.ShapeDtypeStruct((low_NS.shape[0], k), jnp.int32)
  return jax.ffi.ffi_call(ck.SCATTER_TOP_K_TARGET, out, vmap_method="sequential")(low_NS, extra_NE, pos_NE, limit_N)


def _argmax_call(x_NV):
  out = jax.ShapeDtypeStruct((x_NV.shape[0],), jnp.int32)
  return jax.ffi.ffi_call(ck.ARGMAX_TARGET, out, vmap_method="sequential")(x_NV)


def _take_call(buf_NSR, idx_NX):
  n, _, r = buf_NSR.shape
  out = jax.ShapeDtypeStruct((n, idx_NX.shape[1], r), buf_NSR.dtype)
  return jax.ffi.ffi_call(ck.TAKE_ROWS_TARGET, out, vmap_method="sequential")(buf_NSR, idx_NX)


@functools.cache
def _top_k_partitioned(k: int):
  return ck.batch_partitioned(functools.partial(_top_k_call, k), "b s -> b k", 1, ("s", "k"))


@functools.cache
def _scatter_top_k_partitioned(k: int):
  return ck.batch_partitioned(functools.partial(_scatter_top_k_call, k), "b s, b e, b e, b -> b k", 1,
                              ("s", "e", "k"))


@functools.cache
def _argmax_partitioned():
  return ck.batch_partitioned(_argmax_call, "b v -> b", 1, ("v",))


@functools.cache
def _take_partitioned():
  return ck.batch_partitioned(_take_call, "b s r, b x -> b x r", 1, ("s", "r", "x"))
