"""The low-bit device copy shared by KIVI and SpeCache: packed codes + a 16-bit residual ring.

Positions p < len are stored. With residual R (g | R):
  keys   are low-bit for p < key_qlen = R * floor(len / R)   (a whole window of R is quantized when it fills)
  values are low-bit for p < val_qlen = max(0, len - R)      (each token is quantized as it leaves the window)
  the ring [B, K, R, H] holds the last R positions of K and V at slot p % R.
So positions in [val_qlen, key_qlen) have a low-bit key and a 16-bit value; [key_qlen, len) are 16-bit.
Axis letters as in caches/attention.py; C packed bytes, P = S / g key groups.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax import dispatch, quant
from specache_jax.caches import attention as A
from specache_jax.caches import packed


@struct.dataclass
class LowBit:
  k_codes: jax.Array   # uint8 [B, K, S, C]
  k_scale: jax.Array   # [B, K, P, H]
  k_zero: jax.Array    # [B, K, P, H]
  v_codes: jax.Array   # uint8 [B, K, S, C]
  v_scale: jax.Array   # [B, K, S, H/g]
  v_zero: jax.Array    # [B, K, S, H/g]
  ring_k: jax.Array    # [B, K, R, H] 16-bit, slot p % R
  ring_v: jax.Array    # [B, K, R, H]


def boundaries(lengths_B, residual: int):
  """(key_qlen [B], val_qlen [B])."""
  return (lengths_B // residual) * residual, jnp.maximum(lengths_B - residual, 0)


def sixteen_bit_from(lengths_B, residual: int, exact_ring: bool = False):
  """[B]: the first position an attend after lengths_B stored tokens reads in 16-bit from the ring, keys and
  values: key_qlen by KIVI's rule (the ring's slots below it are read with their windows' low-bit keys), or
  with exact_ring the ring's first position, val_qlen (`ring_segment(exact_keys=True)`)."""
  key_qlen, val_qlen = boundaries(lengths_B, residual)
  return val_qlen if exact_ring else key_qlen


def round_slots(max_len: int, residual: int) -> int:
  return -(-max_len // residual) * residual


def init(batch: int, n_kv: int, slots: int, head_dim: int, bits: int, group_size: int, residual: int,
         dtype) -> LowBit:
  c = head_dim * bits // 8
  shape_codes = (batch, n_kv, slots, c)
  return LowBit(
      k_codes=jnp.zeros(shape_codes, jnp.uint8),
      k_scale=jnp.zeros((batch, n_kv, slots // group_size, head_dim), dtype),
      k_zero=jnp.zeros((batch, n_kv, slots // group_size, head_dim), dtype),
      v_codes=jnp.zeros(shape_codes, jnp.uint8),
      v_scale=jnp.zeros((batch, n_kv, slots, head_dim // group_size), dtype),
      v_zero=jnp.zeros((batch, n_kv, slots, head_dim // group_size), dtype),
      ring_k=jnp.zeros((batch, n_kv, residual, head_dim), dtype),
      ring_v=jnp.zeros((batch, n_kv, residual, head_dim), dtype))


def ring_positions(lengths_B, residual: int):
  """[B, R]: the position held by each ring slot (the newest p < len with p % R == slot), -1 if none."""
  slot = jnp.arange(residual, dtype=jnp.int32)[None, :]
  last = lengths_B[:, None] - 1
  pos = last - jnp.mod(last - slot, residual)
  return jnp.where(pos >= 0, pos, -1)


def _window_keys(ring_k, rows_BKIH, lengths_B, bits, group_size, one_bit, dtype):
  """The keys of the ring with rows [B, K, I, H] put in at slots (lengths[b] + i) % R, quantized: what a row
  whose window fills writes."""
  slot = jnp.arange(ring_k.shape[2])[None, None, :, None]
  for i in range(rows_BKIH.shape[2]):
    hit = slot == jnp.mod(lengths_B + i, ring_k.shape[2])[:, None, None, None]
    ring_k = jnp.where(hit, rows_BKIH[:, :, i:i + 1].astype(ring_k.dtype), ring_k)
  return quant.quantize_keys(ring_k, bits, group_size, one_bit, dtype=dtype)


def prefill(st: LowBit, k_BKTH, v_BKTH, lengths_B, *, bits, group_size, residual, one_bit) -> LowBit:
  """Store a right-padded prompt (cache empty before). Groups past a row's key_qlen hold padding that is
  never read as low-bit and is rewritten when the ring flushes."""
  b, n_kv, t, h = k_BKTH.shape
  s = st.k_codes.shape[2]
  t_pad = min(-(-t // residual) * residual, s)
  kp = jnp.pad(k_BKTH, ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))[:, :, :t_pad]
  vp = jnp.pad(v_BKTH, ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))[:, :, :t_pad]
  qk = quant.quantize_keys(kp, bits, group_size, one_bit, dtype=st.k_scale.dtype)
  qv = quant.quantize_values(vp, bits, group_size, one_bit, dtype=st.v_scale.dtype)
  zero = jnp.zeros((b,), jnp.int32)
  ring_pos = ring_positions(lengths_B, residual)                       # [B, R]
  idx = jnp.broadcast_to(jnp.maximum(ring_pos, 0)[:, None, :], (b, n_kv, residual))
  return LowBit(
      k_codes=A.write_rows(st.k_codes, qk.codes, zero),
      k_scale=A.write_rows(st.k_scale, qk.scale, zero),
      k_zero=A.write_rows(st.k_zero, qk.zero, zero),
      v_codes=A.write_rows(st.v_codes, qv.codes, zero),
      v_scale=A.write_rows(st.v_scale, qv.scale, zero),
      v_zero=A.write_rows(st.v_zero, qv.zero, zero),
      ring_k=A.gather_rows(k_BKTH, idx).astype(st.ring_k.dtype),
      ring_v=A.gather_rows(v_BKTH, idx).astype(st.ring_v.dtype))


def store_codes(st: LowBit, k_BKTH, v_BKTH, lengths_B, *, bits, group_size, residual, one_bit, also=()):
  """Store T new rows per batch row at positions lengths[b].. in the low-bit copy: each row's value codes, and
  the key window's codes when a row fills it (quantized from the ring with the rows up to that one put in).
  The ring itself is left as it was: the caller reads it, then writes the rows with `store_ring`.

  also: the caller's own (buffer [B, K, S, ·], rows [B, K, T, ·]) pairs, written at lengths with the first
  row's value codes (SpeCache's simulated 16-bit copy). -> (st, the `also` buffers written).

  On XLA:CPU two conditionals per row (layer and step), each a fence that keeps its writes in place
  (`attention.write_rows`): one around the value codes (and `also`), one around the key window, entered only
  when some row's window fills (every R steps: the ring's quantization was ~2 ms of a 44 ms SmolLM2 step when
  done every step) — formerly 4 + 3·B (+ 2) conditionals. Elsewhere none (a GPU conditional copies its predicate
  to the host and waits): the window is quantized and written every step. A row whose window did not fill writes
  its quantized partial window at its own key_qlen: codes no attend reads before that window's flush rewrites
  them (so no read of the buffer and no per-row conditional)."""
  also = tuple(also)
  for i in range(k_BKTH.shape[2]):
    pos = lengths_B + i
    qv = quant.quantize_values(v_BKTH[:, :, i:i + 1], bits, group_size, one_bit, dtype=st.v_scale.dtype)
    written = A.write_many([(st.v_codes, qv.codes, pos), (st.v_scale, qv.scale, pos), (st.v_zero, qv.zero, pos)]
                           + ([(buf, rows, lengths_B) for buf, rows in also] if i == 0 else []))
    st = st.replace(v_codes=written[0], v_scale=written[1], v_zero=written[2])
    if i == 0:
      also = written[3:]
    new_len = pos + 1
    flush = jnp.mod(new_len, residual) == 0                            # the ring holds [new_len - R, new_len)
    start = jnp.where(flush, new_len - residual, (new_len // residual) * residual)

    def put_window(bufs, ring_k, keys_in, start=start):
      qk = _window_keys(ring_k, keys_in, lengths_B, bits, group_size, one_bit, st.k_scale.dtype)
      return tuple(A.put_rows(buf, rows, at) for buf, rows, at in
                   zip(bufs, (qk.codes, qk.scale, qk.zero), (start, start // group_size, start // group_size)))

    keys = dispatch.on_cpu_only(
        (st.k_codes, st.k_scale, st.k_zero), st.ring_k, k_BKTH[:, :, :i + 1], jnp.any(flush),
        cpu=lambda bufs, r, k, f: jax.lax.cond(f, put_window, lambda bufs, *_: bufs, bufs, r, k),
        default=lambda bufs, r, k, f: put_window(bufs, r, k))
    st = st.replace(k_codes=keys[0], k_scale=keys[1], k_zero=keys[2])
  return st, also


def store_ring(st: LowBit, k_BKTH, v_BKTH, lengths_B, after=None) -> LowBit:
  """Write T new rows into the ring at slots (lengths[b] + i) % R, in place, ordered after `after` (any array
  computed from the old ring): the rows are multiplied by a 1 that XLA cannot prove is 1 without `after`.
  Without such a data dependency XLA copies the ring (twice per layer and step) to keep its old readers
  correct, and an `optimization_barrier` does not prevent the copies (XLA:CPU, measured)."""
  if after is not None:
    one = 1.0 + 0.0 * jnp.isnan(jnp.ravel(after)[0]).astype(k_BKTH.dtype)
    k_BKTH, v_BKTH = k_BKTH * one, v_BKTH * one
  residual = st.ring_k.shape[2]
  ring_k, ring_v = st.ring_k, st.ring_v
  for i in range(k_BKTH.shape[2]):       # unfenced row writes (`A.put_rows`): a fence here made XLA copy the ring
    slot = jnp.mod(lengths_B + i, residual)
    ring_k = A.put_rows(ring_k, k_BKTH[:, :, i:i + 1], slot)
    ring_v = A.put_rows(ring_v, v_BKTH[:, :, i:i + 1], slot)
  return st.replace(ring_k=ring_k, ring_v=ring_v)


def append(st: LowBit, k_BKH, v_BKH, lengths_B, **qargs) -> LowBit:
  """Store one new row per batch row at position lengths[b] (codes and ring), nothing read in between."""
  k, v = k_BKH[:, :, None], v_BKH[:, :, None]
  return store_ring(store_codes(st, k, v, lengths_B, **qargs)[0], k, v, lengths_B)


def packed_segment(st: LowBit, mask, *, bits, group_size) -> A.Computed:
  """The low-bit copy as an attention segment that reads the packed codes (caches/packed.py): scales folded
  into the query per key group and into the probabilities per value group; no dequantized [B,K,S,H] cache."""
  return A.Computed(
      logits=lambda q_BTKGH: packed.key_logits(q_BTKGH, st.k_codes, st.k_scale, st.k_zero, bits=bits,
                                               group_size=group_size),
      weighted_values=lambda p_BKGTS: packed.value_sum(p_BKGTS, st.v_codes, st.v_scale, st.v_zero, bits=bits,
                                                       group_size=group_size),
      mask=mask)


def dequantized(st: LowBit, *, bits, group_size, dtype=jnp.float32):
  """The whole low-bit copy dequantized: (keys [B,K,S,H], values [B,K,S,H]) — the jnp reference path."""
  keys = quant.dequantize_keys(quant.QuantizedKeys(st.k_codes, st.k_scale, st.k_zero), bits, group_size, dtype)
  values = quant.dequantize_values(quant.QuantizedValues(st.v_codes, st.v_scale, st.v_zero), bits,
                                   group_size, dtype)
  return keys, values


def ring_segment(st: LowBit, lengths_B, *, bits, group_size, residual, dtype=jnp.float32, exact_keys=False):
  """The ring as attention columns: (keys [B,K,R,H], values [B,K,R,H], positions [B,K,R]).

  A ring slot whose position is below key_qlen has a quantized key (KIVI's rule), so its key column is the
  dequantized low-bit key (row s of the last flushed window; garbage in slots without a position); above it, the
  16-bit ring key (`cpu_kernels.ring_keys`: a kernel on XLA:CPU beside its jnp reference). exact_keys: every
  slot's 16-bit ring key (the ring holds the last R positions' keys whether or not their window was quantized;
  SpeCache's `exact_ring`). Values are always the 16-bit ring values.
  """
  b, n_kv = st.ring_k.shape[:2]
  pos = jnp.broadcast_to(ring_positions(lengths_B, residual)[:, None, :], (b, n_kv, residual))
  if exact_keys:
    return st.ring_k.astype(dtype), st.ring_v, pos
  keys = dispatch.ring_keys(st.ring_k, st.k_codes, st.k_scale, st.k_zero, lengths_B, bits=bits,
                            group_size=group_size, dtype=dtype)
  return keys, st.ring_v, pos
