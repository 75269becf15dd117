"""Attention math shared by every cache method.

Axis legend (the one alphabet of the project):
  B batch   T query rows (new tokens)   S cached slots / key columns   N query heads   K KV heads
  G query heads per KV head (N = K*G; query head n reads KV head n // G)   H head dim
A "segment" is one set of key/value columns with its own mask; several segments share one softmax, which is
how a method mixes low-bit columns, 16-bit fetched rows, a residual window and the new tokens exactly.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so a fully masked row yields zeros-weighted garbage instead of NaN


def split_heads(q, n_kv: int):
  """q [B, T, N, H] -> [B, T, K, G, H]."""
  b, t, n, h = q.shape
  return q.reshape(b, t, n_kv, n // n_kv, h)


def segment_logits(q_BTKGH, keys_BKSH, mask_BKTS, sm_scale: float):
  """float32 logits [B, K, G, T, S]; masked columns set to MASKED. mask may have K=1 (broadcast)."""
  logits = jnp.einsum("btkgh,bksh->bkgts", q_BTKGH.astype(jnp.float32), keys_BKSH.astype(jnp.float32))
  logits = logits * sm_scale
  mask = jnp.broadcast_to(mask_BKTS[:, :, None], logits.shape)
  return jnp.where(mask, logits, MASKED)


def segmented_attention(q_BTNH, segments: Sequence[tuple], sm_scale: float, n_kv: int,
                        logits_override: Sequence | None = None):
  """One softmax over several column segments.

  segments: [(keys [B,K,S_i,H], values [B,K,S_i,H], mask [B,K|1,T,S_i] bool), ...]
  logits_override: optional per-segment precomputed logits [B,K,G,T,S_i] (e.g. from a packed-key kernel),
    None entries are computed from the keys.
  Returns out [B,T,N,H] (q.dtype) and probs per segment [B,K,G,T,S_i] float32.
  """
  q = split_heads(q_BTNH, n_kv)
  logits = []
  for i, (keys, _, mask) in enumerate(segments):
    pre = None if logits_override is None else logits_override[i]
    if pre is None:
      logits.append(segment_logits(q, keys, mask, sm_scale))
    else:
      full_mask = jnp.broadcast_to(mask[:, :, None], pre.shape)
      logits.append(jnp.where(full_mask, pre, MASKED))
  sizes = [l.shape[-1] for l in logits]
  all_logits = jnp.concatenate(logits, axis=-1) if len(logits) > 1 else logits[0]
  probs_all = jax.nn.softmax(all_logits, axis=-1)                         # [B, K, G, T, sum S_i]
  probs, out, start = [], 0.0, 0
  for (_, values, _), size in zip(segments, sizes):
    p = probs_all[..., start:start + size]
    start += size
    probs.append(p)
    out = out + jnp.einsum("bkgts,bksh->btkgh", p, values.astype(jnp.float32))
  b, t, n, h = q_BTNH.shape
  return out.reshape(b, t, n, h).astype(q_BTNH.dtype), probs


def causal_new_mask(batch: int, t: int):
  """Mask [B, 1, T, T] of the new rows among themselves: row i sees rows j <= i."""
  m = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  return jnp.broadcast_to(m[None, None], (batch, 1, t, t))


def valid_cols_mask(lengths_B, s: int, t: int):
  """Mask [B, 1, T, S]: slot s < lengths[b] (the cached part every new row may see)."""
  m = jnp.arange(s)[None, :] < lengths_B[:, None]                        # [B, S]
  return jnp.broadcast_to(m[:, None, None, :], (lengths_B.shape[0], 1, t, s))


def write_rows(buf_BKSH, rows_BKTH, start_B):
  """Write rows [B, K, T, H] into buf [B, K, S, H] at slot start[b] per batch row."""
  def one(buf, rows, start):
    return jax.lax.dynamic_update_slice(buf, rows.astype(buf.dtype), (0, start, 0))
  return jax.vmap(one)(buf_BKSH, rows_BKTH, start_B)


def gather_rows(buf_BKSH, idx_BKX):
  """Rows of buf [B, K, S, H] at slots idx [B, K, X] -> [B, K, X, H] (idx clipped into range)."""
  idx = jnp.clip(idx_BKX, 0, buf_BKSH.shape[2] - 1)
  return jnp.take_along_axis(buf_BKSH, idx[..., None], axis=2)


def prefill_attention(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale: float, want_colsum: bool,
                      chunk: int = 1024):
  """Causal self-attention over a right-padded prompt, queries in chunks to bound memory.

  Returns out [B,T,N,H] and, if want_colsum, the attention each key received summed over valid query rows
  and averaged over the G heads of its group: colsum [B, K, T] float32 (what H2O accumulates).
  """
  b, t, n, h = q_BTNH.shape
  n_kv = k_BTKH.shape[2]
  keys = jnp.swapaxes(k_BTKH, 1, 2)                                       # [B, K, T, H]
  values = jnp.swapaxes(v_BTKH, 1, 2)
  key_pos = jnp.arange(t)
  key_valid = key_pos[None, :] < lengths_B[:, None]                       # [B, T]

  def attend_chunk(q_chunk, q_pos):
    # q_chunk [B, C, N, H], q_pos [C]
    c = q_chunk.shape[1]
    mask = (q_pos[:, None] >= key_pos[None, :])[None] & key_valid[:, None, :]   # [B, C, T]
    mask = mask[:, None]                                                  # [B, 1, C, T]
    out, (p,) = segmented_attention(q_chunk, [(keys, values, mask)], sm_scale, n_kv)
    if not want_colsum:
      return out, jnp.zeros((b, n_kv, t), jnp.float32)
    row_valid = (q_pos[None, :] < lengths_B[:, None]).astype(jnp.float32)  # [B, C]
    col = jnp.einsum("bkgcs,bc->bks", p, row_valid) / (n // n_kv)
    del c
    return out, col

  if t <= chunk:
    out, col = attend_chunk(q_BTNH, jnp.arange(t))
    return out, (col if want_colsum else None)
  n_chunks = -(-t // chunk)
  pad = n_chunks * chunk - t
  q_pad = jnp.pad(q_BTNH, ((0, 0), (0, pad), (0, 0), (0, 0)))
  q_chunks = jnp.moveaxis(q_pad.reshape(b, n_chunks, chunk, n, h), 1, 0)  # [n_chunks, B, C, N, H]
  pos_chunks = jnp.arange(n_chunks * chunk).reshape(n_chunks, chunk)

  def body(colsum, xs):
    qc, pc = xs
    out, col = attend_chunk(qc, pc)
    return colsum + col, out

  colsum, outs = jax.lax.scan(body, jnp.zeros((b, n_kv, t), jnp.float32), (q_chunks, pos_chunks))
  out = jnp.moveaxis(outs, 0, 1).reshape(b, n_chunks * chunk, n, h)[:, :t]
  return out, (colsum if want_colsum else None)
