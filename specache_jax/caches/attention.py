"""Attention math shared by every cache method.

Axis legend (the one alphabet of the project):
  B batch   T query rows (new tokens)   S cached slots / key columns   N query heads   K KV heads
  G query heads per KV head (N = K*G; query head n reads KV head n // G)   H head dim
A "segment" is one set of key/value columns with its own mask; several segments share one softmax, which is
how a method mixes low-bit columns, 16-bit fetched rows, a residual window and the new tokens exactly.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from specache_jax import dispatch

MASKED = -1e30  # finite, so a fully masked row yields zeros-weighted garbage instead of NaN


def split_heads(q, n_kv: int):
  """q [B, T, N, H] -> [B, T, K, G, H]."""
  b, t, n, h = q.shape
  return q.reshape(b, t, n_kv, n // n_kv, h)


def bk_dot(x_BKMC, y_BK__, y_contract: int):
  """Batched matmul over the leading axes (B, K): x [B, K, M, C] contracted on its last axis with y's axis
  `y_contract` (2 or 3) -> [B, K, M, N].

  The operand order matters on XLA:CPU: an einsum whose batch axes are not leading in the query and output
  ("btkgh,bksh->bkgts") lowers to a dot with transposes around it (measured at S=8192, K=3, G=3: 4.5 ms per
  layer, 2.8 GB/s; this form: 0.75 ms). The cache operand is used as stored (no reshape: a reshaped view of a
  buffer that was just updated in place makes XLA copy it)."""
  if y_contract not in (2, 3):
    raise ValueError(f"{y_contract=} must be 2 or 3 (an axis of y after B, K)")
  return jax.lax.dot_general(x_BKMC, y_BK__, (((3,), (y_contract,)), ((0, 1), (0, 1))))


def query_rows(q_BTKGH):
  """[B, T, K, G, H] -> float32 [B, K, M, H] with M = G*T query rows per KV head (m = g_idx * T + t)."""
  b, t, n_kv, g, h = q_BTKGH.shape
  return jnp.transpose(q_BTKGH, (0, 2, 3, 1, 4)).reshape(b, n_kv, g * t, h).astype(jnp.float32)


def segment_logits(q_BTKGH, keys_BKSH, mask_BKTS, sm_scale: float):
  """float32 logits [B, K, G, T, S]; masked columns set to MASKED. mask may have K=1 (broadcast)."""
  b, t, n_kv, g, _ = q_BTKGH.shape
  logits = bk_dot(query_rows(q_BTKGH), keys_BKSH.astype(jnp.float32), 3).reshape(b, n_kv, g, t, -1)
  logits = logits * sm_scale
  mask = jnp.broadcast_to(mask_BKTS[:, :, None], logits.shape)
  return jnp.where(mask, logits, MASKED)


def weighted_values(p_BKGTS, values_BKSH):
  """Σ_s p_s v_s: float32 [B, T, K, G, H]."""
  b, n_kv, g, t, s = p_BKGTS.shape
  out = bk_dot(p_BKGTS.reshape(b, n_kv, g * t, s), values_BKSH.astype(jnp.float32), 2)
  return jnp.transpose(out.reshape(b, n_kv, g, t, -1), (0, 3, 1, 2, 4))


class Computed(NamedTuple):
  """A column segment that computes its own logits and value sum (e.g. from packed low-bit codes).

  logits: (q [B,T,K,G,H]) -> float32 [B,K,G,T,S] unscaled q·k;  weighted_values: (p [B,K,G,T,S] float32) ->
  float32 [B,T,K,G,H] = Σ_s p_s v_s;  mask: [B,K|1,T,S] bool."""
  logits: Callable
  weighted_values: Callable
  mask: jax.Array


def segmented_attention(q_BTNH, segments: Sequence, sm_scale: float, n_kv: int):
  """One softmax over several column segments.

  segments: each (keys [B,K,S_i,H], values [B,K,S_i,H], mask [B,K|1,T,S_i] bool) or a `Computed` segment.
  Returns out [B,T,N,H] (q.dtype) and probs per segment [B,K,G,T,S_i] float32.
  """
  q = split_heads(q_BTNH, n_kv)
  logits = []
  for seg in segments:
    if isinstance(seg, Computed):
      pre = seg.logits(q) * sm_scale
      logits.append(jnp.where(jnp.broadcast_to(seg.mask[:, :, None], pre.shape), pre, MASKED))
    else:
      keys, _, mask = seg
      logits.append(segment_logits(q, keys, mask, sm_scale))
  sizes = [l.shape[-1] for l in logits]
  all_logits = jnp.concatenate(logits, axis=-1) if len(logits) > 1 else logits[0]
  probs_all = jax.nn.softmax(all_logits, axis=-1)                         # [B, K, G, T, sum S_i]
  probs, out, start = [], 0.0, 0
  for seg, size in zip(segments, sizes):
    p = probs_all[..., start:start + size]
    start += size
    probs.append(p)
    if isinstance(seg, Computed):
      out = out + seg.weighted_values(p)
    else:
      out = out + weighted_values(p, seg[1])
  b, t, n, h = q_BTNH.shape
  return out.reshape(b, t, n, h).astype(q_BTNH.dtype), probs


def causal_new_mask(batch: int, t: int):
  """Mask [B, 1, T, T] of the new rows among themselves: row i sees rows j <= i (`new_rows_mask` of consecutive
  positions)."""
  return new_rows_mask(batch, tuple(range(t)))


def new_rows_mask(batch: int, offsets):
  """Mask [B, 1, T, T] of new rows at position offsets `offsets` (`Speculation.row_offsets`): row i sees row j
  when j sits at an earlier position, and itself (rows at the same position — alternative candidates — never
  see each other). Consecutive offsets give `causal_new_mask`."""
  off = jnp.asarray(offsets, jnp.int32)
  m = (off[None, :] < off[:, None]) | jnp.eye(len(offsets), dtype=bool)
  return jnp.broadcast_to(m[None, None], (batch, 1) + m.shape)


def valid_cols_mask(lengths_B, s: int, t: int):
  """Mask [B, 1, T, S]: slot s < lengths[b] (the cached part every new row may see)."""
  m = jnp.arange(s)[None, :] < lengths_B[:, None]                        # [B, S]
  return jnp.broadcast_to(m[:, None, None, :], (lengths_B.shape[0], 1, t, s))


def read_before_write(result, state):
  """Order a state's in-place update after what was read from it: `state` comes back tied to `result`, so the
  scatter that follows depends on the reads and XLA updates the buffers in place instead of copying them
  (with an independent reader and writer of one buffer, XLA copies it to keep both orders legal)."""
  return jax.lax.optimization_barrier((result, state))


def write_rows(buf_BKSX, rows_BKTX, start_B):
  """Write rows [B, K, T, X] into buf [B, K, S, X] at slot start[b] per batch row (start must be >= 0).

  One `dynamic_update_slice` per batch row (`put_rows`). The updates sit inside a `lax.cond` (its predicate,
  start >= 0, always holds): the conditional is a fusion barrier, so the update runs in place on the buffer
  itself. Without it XLA fuses the update into the readers that follow (an attention dot views the buffer as
  [B*K, S, X]) and copies the whole buffer, twice per layer and step (measured on a 3-head 8k layer: 5.0 ms with
  the copies, 1.3 ms without). The conditional is CPU-only (`lax.platform_dependent`): on a GPU it would copy its
  predicate to the host and wait, every layer. `write_many`: several writes under one conditional."""
  return write_many([(buf_BKSX, rows_BKTX, start_B)])[0]


def write_many(writes):
  """`write_rows` for each (buf, rows, start_B) of `writes`, all under one conditional (XLA:CPU: one fence per
  layer and step instead of one per buffer). -> the buffers written, in order."""
  def put(bufs, starts):
    return tuple(put_rows(buf, rows, start) for buf, (_, rows, _), start in zip(bufs, writes, starts))

  def fenced(bufs, starts):
    holds = jnp.all(jnp.stack([jnp.all(start >= 0) for start in starts]))
    return jax.lax.cond(holds, put, lambda bufs, _: bufs, bufs, starts)

  bufs, starts = tuple(w[0] for w in writes), tuple(w[2] for w in writes)
  return dispatch.on_cpu_only(bufs, starts, cpu=fenced, default=put)


def put_rows(buf_BKSX, rows_BKTX, start_B):
  """`write_rows` without its fence (for a caller whose conditional fences several writes): one
  `dynamic_update_slice` per batch row (B is static; a vmapped update becomes a scatter, which XLA:CPU runs as a
  loop over the WHOLE buffer: a full-cache step at 8k took 4x longer)."""
  rows = rows_BKTX.astype(buf_BKSX.dtype)
  tail = (0,) * (buf_BKSX.ndim - 3)
  for b in range(buf_BKSX.shape[0]):
    buf_BKSX = jax.lax.dynamic_update_slice(buf_BKSX, rows[b:b + 1], (b, 0, start_B[b]) + tail)
  return buf_BKSX


def gather_rows(buf_BKSH, idx_BKX):
  """Rows of buf [B, K, S, H] at slots idx [B, K, X] -> [B, K, X, H] (idx clipped into range). On XLA:CPU a copy
  of whole rows (`cpu_kernels.select.take_rows`; XLA's gather computes an index per element)."""
  return dispatch.take_rows(buf_BKSH, idx_BKX)


def block_rows(blocks_BKX, size: int, first: int = 0):
  """[B, K, X·size] int32: the positions of X runs of `size` consecutive rows, run j at first + j·size (Quest's
  pages, InfLLM's memory blocks)."""
  b, k, x = blocks_BKX.shape
  rows = first + blocks_BKX[..., None] * size + jnp.arange(size, dtype=jnp.int32)[None, None, None, :]
  return rows.reshape(b, k, x * size)


@dataclasses.dataclass(frozen=True)
class PrefillBlocks:
  """Tile sizes of the blockwise prefill attention: query rows and key columns per step."""
  block_q: int = 256   # query positions per block (each block holds block_q * G rows of one KV head)
  block_k: int = 512   # key columns per step of the online softmax (256x512: 124 GFLOP/s at T=8192 on the
                       # 2-core CPU vs 100 for 256x256, 121 for 512x512: experiments/prefill_bench.py)

  def validate(self) -> "PrefillBlocks":
    for name, size in (("block_q", self.block_q), ("block_k", self.block_k)):
      if not isinstance(size, int) or size < 8 or size % 8:
        raise ValueError(f"{name}={size!r} must be an int multiple of 8")
    return self


def _block_logits(q_BKRH, k_BKSH, col0, limit_BR, masked: bool):
  """Logits of a query block against key columns [col0, col0 + S); if masked, column c > limit[row] -> MASKED."""
  s_BKRS = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, k_BKSH)
  if not masked:
    return s_BKRS
  col_S = col0 + jnp.arange(k_BKSH.shape[2])
  visible_BRS = col_S[None, None, :] <= limit_BR[:, :, None]
  return jnp.where(visible_BRS[:, None], s_BKRS, MASKED)


def _kv_blocks_needed(i, block_q: int, block_k: int, n_kv_blocks: int, max_len):
  """Key blocks query block i reads: up to its last row's diagonal and the longest prompt, no further."""
  causal = ((i + 1) * block_q + block_k - 1) // block_k
  valid = (max_len + block_k - 1) // block_k
  return jnp.minimum(jnp.minimum(causal, valid), n_kv_blocks)


def _kv_blocks_unmasked(limit_BR, block_k: int, n_steps):
  """Leading key blocks every row of a query block sees whole (no mask needed): columns <= min limit."""
  return jnp.minimum((jnp.min(limit_BR) + 1) // block_k, n_steps)


def prefill_attention(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale: float, want_colsum: bool,
                      blocks: PrefillBlocks = PrefillBlocks()):
  """Causal self-attention over a right-padded prompt: `prefill_attention_blockwise`, or on XLA:CPU without the
  column sums the register-tiled kernel of the same contract (`cpu_kernels.prefill_attention`; head_dim a
  multiple of 64; ~1.4-2.4x the blockwise form's speed on the 2-core CPU). Same returns as the blockwise form
  (a prompt of length 0, which the API rejects, gives zeros from the kernel and a meaningless average from the
  blockwise form)."""
  if want_colsum:
    return prefill_attention_blockwise(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale, True, blocks)
  out = dispatch.prefill_attention("auto", lambda *a: prefill_attention_blockwise(*a, sm_scale, False, blocks)[0],
                                    q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale)
  return out, None


def prefill_attention_blockwise(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale: float, want_colsum: bool,
                                blocks: PrefillBlocks = PrefillBlocks()):
  """Causal self-attention over a right-padded prompt, blockwise (flash-style online softmax).

  Query blocks of `block_q` positions (times the G heads of a KV head) walk the key blocks up to their
  diagonal (and the longest prompt) with a running max and normaliser; blocks above the diagonal are never
  computed and no [T, T] matrix is formed. Row t of prompt b sees keys j <= min(t, lengths[b] - 1), so rows
  past a prompt's length (padding) attend to the whole prompt, as the dense reference does.
  Returns out [B,T,N,H] (q.dtype) and, if want_colsum, the attention each key received summed over valid
  query rows and averaged over the G heads of its group: colsum [B, K, T] float32 (what H2O accumulates),
  from a second pass over the same blocks with each row's final log-sum-exp.
  """
  blocks.validate()
  b, t, n, h = q_BTNH.shape
  n_kv = k_BTKH.shape[2]
  g = n // n_kv
  bq, bk = (t, t) if t <= min(blocks.block_q, blocks.block_k) else (blocks.block_q, blocks.block_k)
  n_q_blocks, n_kv_blocks = -(-t // bq), -(-t // bk)
  tq, tk = n_q_blocks * bq, n_kv_blocks * bk
  rows = bq * g                                                           # R: (position, group head) pairs

  q = (q_BTNH.astype(jnp.float32) * sm_scale).reshape(b, t, n_kv, g, h)
  q = jnp.pad(q, ((0, 0), (0, tq - t), (0, 0), (0, 0), (0, 0)))
  q_QBKRH = jnp.transpose(q.reshape(b, n_q_blocks, bq, n_kv, g, h), (1, 0, 3, 2, 4, 5)).reshape(
      n_q_blocks, b, n_kv, rows, h)                                       # row r = position * G + group head
  keys_BKSH = jnp.pad(jnp.swapaxes(k_BTKH.astype(jnp.float32), 1, 2), ((0, 0), (0, 0), (0, tk - t), (0, 0)))
  values_BKSH = jnp.pad(jnp.swapaxes(v_BTKH.astype(jnp.float32), 1, 2), ((0, 0), (0, 0), (0, tk - t), (0, 0)))
  lengths_B = lengths_B.astype(jnp.int32)
  pos_T = jnp.arange(tq, dtype=jnp.int32)
  limit_BT = jnp.minimum(pos_T[None, :], lengths_B[:, None] - 1)          # last key column each row sees
  limit_QBR = jnp.swapaxes(jnp.repeat(limit_BT, g, axis=1).reshape(b, n_q_blocks, rows), 0, 1)
  max_len = jnp.max(lengths_B)
  block_ids = jnp.arange(n_q_blocks, dtype=jnp.int32)

  def query_block(_, xs):
    i, q_BKRH, limit_BR = xs

    def kv_step(j, state, masked: bool):
      m_BKR, l_BKR, acc_BKRH = state
      col0 = j * bk
      k_BKSH = jax.lax.dynamic_slice_in_dim(keys_BKSH, col0, bk, axis=2)
      v_BKSH = jax.lax.dynamic_slice_in_dim(values_BKSH, col0, bk, axis=2)
      s_BKRS = _block_logits(q_BKRH, k_BKSH, col0, limit_BR, masked)
      m_new_BKR = jnp.maximum(m_BKR, jnp.max(s_BKRS, axis=-1))
      p_BKRS = jnp.exp(s_BKRS - m_new_BKR[..., None])
      rescale_BKR = jnp.exp(m_BKR - m_new_BKR)
      l_BKR = l_BKR * rescale_BKR + jnp.sum(p_BKRS, axis=-1)
      acc_BKRH = acc_BKRH * rescale_BKR[..., None] + jnp.einsum("bkrs,bksh->bkrh", p_BKRS, v_BKSH)
      return m_new_BKR, l_BKR, acc_BKRH

    init = (jnp.full((b, n_kv, rows), MASKED, jnp.float32), jnp.zeros((b, n_kv, rows), jnp.float32),
            jnp.zeros((b, n_kv, rows, h), jnp.float32))
    n_steps = _kv_blocks_needed(i, bq, bk, n_kv_blocks, max_len)
    n_open = _kv_blocks_unmasked(limit_BR, bk, n_steps)
    state = jax.lax.fori_loop(0, n_open, functools.partial(kv_step, masked=False), init)
    m_BKR, l_BKR, acc_BKRH = jax.lax.fori_loop(n_open, n_steps, functools.partial(kv_step, masked=True), state)
    l_BKR = jnp.maximum(l_BKR, jnp.finfo(jnp.float32).tiny)              # a block past every prompt: no keys
    return None, (acc_BKRH / l_BKR[..., None], m_BKR + jnp.log(l_BKR))

  _, (out_QBKRH, lse_QBKR) = jax.lax.scan(query_block, None, (block_ids, q_QBKRH, limit_QBR))
  out = jnp.transpose(out_QBKRH.reshape(n_q_blocks, b, n_kv, bq, g, h), (1, 0, 3, 2, 4, 5))
  out_BTNH = out.reshape(b, tq, n, h)[:, :t].astype(q_BTNH.dtype)
  if not want_colsum:
    return out_BTNH, None

  row_weight_BT = (pos_T[None, :] < lengths_B[:, None]).astype(jnp.float32) / g
  weight_QBR = jnp.swapaxes(jnp.repeat(row_weight_BT, g, axis=1).reshape(b, n_q_blocks, rows), 0, 1)

  def colsum_block(colsum_BKS, xs):
    i, q_BKRH, limit_BR, lse_BKR, weight_BR = xs

    def kv_step(j, colsum_BKS, masked: bool):
      col0 = j * bk
      k_BKSH = jax.lax.dynamic_slice_in_dim(keys_BKSH, col0, bk, axis=2)
      s_BKRS = _block_logits(q_BKRH, k_BKSH, col0, limit_BR, masked)
      p_BKRS = jnp.exp(s_BKRS - lse_BKR[..., None])
      col_BKS = jnp.einsum("bkrs,br->bks", p_BKRS, weight_BR)
      seen_BKS = jax.lax.dynamic_slice_in_dim(colsum_BKS, col0, bk, axis=2)
      return jax.lax.dynamic_update_slice_in_dim(colsum_BKS, seen_BKS + col_BKS, col0, axis=2)

    n_steps = _kv_blocks_needed(i, bq, bk, n_kv_blocks, max_len)
    n_open = _kv_blocks_unmasked(limit_BR, bk, n_steps)
    colsum_BKS = jax.lax.fori_loop(0, n_open, functools.partial(kv_step, masked=False), colsum_BKS)
    return jax.lax.fori_loop(n_open, n_steps, functools.partial(kv_step, masked=True), colsum_BKS), None

  colsum_BKS, _ = jax.lax.scan(colsum_block, jnp.zeros((b, n_kv, tk), jnp.float32),
                               (block_ids, q_QBKRH, limit_QBR, lse_QBKR, weight_QBR))
  return out_BTNH, colsum_BKS[:, :, :t]


def prefill_attention_reference(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale: float, want_colsum: bool,
                                chunk: int = 1024):
  """Dense float32 reference of `prefill_attention` (queries in chunks, logits against all T keys).

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
