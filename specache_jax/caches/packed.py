"""Low-bit attention that reads the PACKED cache of `lowbit.LowBit` (pure XLA; the CPU/TPU path).

Axis letters as in caches/attention.py; C packed bytes per row, P = S / g key groups, J = 8 / b codes per
byte, M = G·T query rows of one KV head (g-major: m = g_idx·T + t), I = g slots of one key group.

Layouts (docs/design.md): keys codes [B, K, S, C] uint8 packed along H, per-channel groups of g tokens, scale/zero
[B, K, P, H]; values codes [B, K, S, C], per-token groups of g channels, scale/zero [B, K, S, H/g]. Code j of a
row sits in byte j // J at bit (j % J)·b.

  key_logits  q·k̂ for every slot, with the key scales folded into the query per key group:
              q·k̂_s = Σ_h q_h z_{p,h} + Σ_h (q_h s_{p,h}) code_{s,h}      (p = s // g)
              One XLA loop fusion over the [B, K, M, P, I] logits: each logit sums H terms (in 4 running
              sums) (q_h s_{p,h}) · code_{s,h}, read straight from the byte-transposed codes [B, K, C, S]
              (1-bit: a select; b > 1: float(byte & (mask << jb)) · (q_h s_{p,h} 2^-jb), the shift folded
              into the query exactly). No dot, no loop, nothing of size [B, K, S, H] is written.
  value_sum   Σ_s p_s v̂_s, blockwise: a `fori_loop` over S-blocks sized so the dequantized block
              [B, K, block, H] float32 stays in L2 (`auto_block_s`); per block one unpack+dequantize fusion
              and one dot [M, block] x [block, H]; a ragged tail is one extra static block.

Both accumulate in float32 and agree with the dequantize-then-einsum references to ~1e-7 relative. Every
input slot is read (the caller masks logits and zeroes probabilities of unused slots); like the references,
scale/zero must be finite at every slot (0 · NaN is NaN), and the products q·s, p·ŝ must not overflow
(the references' overflow fallback of `quant.dequantize_minmax` is not reproduced).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from specache_jax import quant
from specache_jax.caches import attention as A

L2_BLOCK_BYTES = 768 * 1024   # dequantized value block [B, K, block, H] float32 kept under this (L2 = 1 MiB)
MIN_BLOCK_S = 128
N_ACCUMULATORS = 4            # running sums per logit in key_logits


def _check(codes_BKSC, scale, zero, bits: int, group_size: int, head_dim: int, what: str) -> None:
  if bits not in quant.BITS:
    raise ValueError(f"{bits=} is not supported; expected one of {quant.BITS}")
  if group_size <= 0:
    raise ValueError(f"{group_size=} must be > 0")
  if codes_BKSC.dtype != jnp.uint8:
    raise ValueError(f"{what} codes dtype {codes_BKSC.dtype} must be uint8")
  if codes_BKSC.shape[-1] * 8 != head_dim * bits:
    raise ValueError(f"{what} codes C={codes_BKSC.shape[-1]} does not hold head_dim={head_dim} codes of "
                     f"{bits=} (need C * 8 = H * b)")
  if scale.shape != zero.shape:
    raise ValueError(f"{what} scale {scale.shape} and zero {zero.shape} differ")


def _pairwise_sum(terms):
  while len(terms) > 1:
    terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
  return terms[0]


def _interleaved_sum(terms, n_acc: int = N_ACCUMULATORS):
  """Σ terms as n_acc running sums (term i into sum i % n_acc), then pairwise: a short dependency chain per
  sum without the register spills of a full pairwise tree (measured ~1.3x faster for 1-bit keys)."""
  accs = [None] * min(n_acc, len(terms))
  for i, term in enumerate(terms):
    r = i % len(accs)
    accs[r] = term if accs[r] is None else accs[r] + term
  return _pairwise_sum(accs)


def _field_term(byte, j: int, bits: int, weight):
  """weight · code_j(byte) for the j-th b-bit field, with weight pre-multiplied by 2^-(j·b) when b > 1."""
  field_mask = (2**bits - 1) << (j * bits)
  if bits == 1:
    return jnp.where((byte & jnp.uint8(field_mask)) != 0, weight, 0.0)
  return (byte & jnp.uint8(field_mask)).astype(jnp.float32) * weight


# ---------------------------------------------------------------------------------------------------- keys

def key_logits(q_BTKGH, k_codes, k_scale, k_zero, *, bits: int, group_size: int):
  """q · dequant(k) for every slot: float32 [B, K, G, T, S] (not scaled by sm_scale, not masked).

  q [B, T, K, G, H]; k_codes uint8 [B, K, S, C]; k_scale, k_zero [B, K, S/g, H].
  """
  b, t, n_kv, n_rep, h = q_BTKGH.shape
  _check(k_codes, k_scale, k_zero, bits, group_size, h, "key")
  s = k_codes.shape[2]
  n_groups = k_scale.shape[2]
  if n_groups * group_size != s:
    raise ValueError(f"{group_size=} does not match key codes S={s} and scale P={n_groups} (need S = P * g)")
  per = 8 // bits
  c = h // per
  m = n_rep * t
  q_BKMH = A.query_rows(q_BTKGH)
  qs_BKMPCJ = jnp.einsum("bkmh,bkph->bkmph", q_BKMH, k_scale.astype(jnp.float32)).reshape(
      b, n_kv, m, n_groups, c, per)
  if bits > 1:
    pow2_J = 2.0 ** (-bits * jnp.arange(per, dtype=jnp.float32))
    qs_BKMPCJ = qs_BKMPCJ * pow2_J.reshape(1, 1, 1, 1, 1, per)                   # exact powers of two
  qz_BKMP = jnp.einsum("bkmh,bkph->bkmp", q_BKMH, k_zero.astype(jnp.float32))
  codes_BK1CPI = jnp.swapaxes(k_codes, 2, 3).reshape(b, n_kv, 1, c, n_groups, group_size)
  terms = [jnp.broadcast_to(qz_BKMP[..., None], (b, n_kv, m, n_groups, group_size))]
  for ci in range(c):
    byte_BK1PI = codes_BK1CPI[:, :, :, ci]
    for j in range(per):
      terms.append(_field_term(byte_BK1PI, j, bits, qs_BKMPCJ[:, :, :, :, ci, j, None]))
  logits_BKMPI = _interleaved_sum(terms)
  return logits_BKMPI.reshape(b, n_kv, n_rep, t, s)


def _dequant_keys(codes_BKSC, scale_BKPH, zero_BKPH, bits: int, group_size: int):
  """Packed key rows (whole groups) -> float32 [B, K, S, H]."""
  b, n_kv, s, _ = codes_BKSC.shape
  n_groups, h = scale_BKPH.shape[2:]
  codes = _unpack_f32(codes_BKSC, bits, h).reshape(b, n_kv, n_groups, group_size, h)
  k = codes * scale_BKPH.astype(jnp.float32)[:, :, :, None] + zero_BKPH.astype(jnp.float32)[:, :, :, None]
  return k.reshape(b, n_kv, s, h)


def key_logits_blocked(q_BTKGH, k_codes, k_scale, k_zero, *, bits: int, group_size: int,
                       block_s: int | None = None):
  """`key_logits` as a loop over S-blocks (dequantize one block into L2, then a dot [M, H] x [H, block])."""
  b, t, n_kv, n_rep, h = q_BTKGH.shape
  _check(k_codes, k_scale, k_zero, bits, group_size, h, "key")
  s = k_codes.shape[2]
  if k_scale.shape[2] * group_size != s:
    raise ValueError(f"{group_size=} does not match key codes S={s} and scale P={k_scale.shape[2]}")
  blk = auto_block_s(b, n_kv, h, s, group_size) if block_s is None else block_s
  if blk <= 0 or blk % group_size:
    raise ValueError(f"block_s={blk} must be a positive multiple of {group_size=}")
  q_BKMH = A.query_rows(q_BTKGH)

  def logits_of(start, size):
    codes = lax.dynamic_slice_in_dim(k_codes, start, size, 2)
    scale = lax.dynamic_slice_in_dim(k_scale, start // group_size, size // group_size, 2)
    zero = lax.dynamic_slice_in_dim(k_zero, start // group_size, size // group_size, 2)
    return jnp.einsum("bkmh,bksh->bkms", q_BKMH, _dequant_keys(codes, scale, zero, bits, group_size))

  out_BKMS = _blocked(s, blk, logits_of, jnp.zeros((b, n_kv, n_rep * t, s), jnp.float32), accumulate=False)
  return out_BKMS.reshape(b, n_kv, n_rep, t, s)


def key_logits_reference(q_BTKGH, k_codes, k_scale, k_zero, *, bits: int, group_size: int):
  """float32 reference: dequantize every key with `quant`, then an einsum. [B, K, G, T, S]."""
  keys_BKSH = quant.dequantize_keys(quant.QuantizedKeys(k_codes, k_scale, k_zero), bits, group_size)
  return jnp.einsum("btkgh,bksh->bkgts", q_BTKGH.astype(jnp.float32), keys_BKSH)


# -------------------------------------------------------------------------------------------------- values

def _unpack_f32(codes_XC, bits: int, head_dim: int):
  """uint8 [..., C] -> float32 codes [..., H].

  The bytes are read as little-endian uint32 words (uint16 / bytes when C is not a multiple of 4): field k
  of word w is code 4·w·J + k, the natural order. XLA vectorizes the unpack over the fields of a word, so a
  word with >= 8 fields keeps it vectorized for 2- and 4-bit codes (bytes alone give 4 or 2 lanes and a
  scalar loop)."""
  if bits == 8:
    return codes_XC.astype(jnp.float32)
  c = codes_XC.shape[-1]
  word_bytes = 4 if c % 4 == 0 else 2 if c % 2 == 0 else 1
  word_dtype = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[word_bytes]
  words = codes_XC.reshape(codes_XC.shape[:-1] + (c // word_bytes, word_bytes))
  words = lax.bitcast_convert_type(words, word_dtype) if word_bytes > 1 else words[..., 0]   # [..., W]
  per_word = 8 * word_bytes // bits
  shape = words.shape + (per_word,)
  # field k = (word >> k·b) & mask, as b shifts by an iota k: XLA keeps a bare iota inside the unpack loop and
  # vectorizes it, while k·b becomes a small array passed in as a buffer and the loop runs scalar
  k = lax.broadcasted_iota(word_dtype, shape, words.ndim)
  fields = jnp.broadcast_to(words[..., None], shape)
  for _ in range(bits):
    fields = fields >> k
  fields = fields & jnp.asarray(2**bits - 1, word_dtype)                          # [..., W, 8·bytes/b]
  return fields.astype(jnp.float32).reshape(codes_XC.shape[:-1] + (head_dim,))


def _dequant_values(codes_BKSC, scale_BKSQ, zero_BKSQ, bits: int, group_size: int):
  """Packed value rows -> float32 [B, K, S, H]."""
  b, n_kv, s, _ = codes_BKSC.shape
  n_q = scale_BKSQ.shape[3]
  h = n_q * group_size
  codes = _unpack_f32(codes_BKSC, bits, h).reshape(b, n_kv, s, n_q, group_size)
  v = codes * scale_BKSQ.astype(jnp.float32)[..., None] + zero_BKSQ.astype(jnp.float32)[..., None]
  return v.reshape(b, n_kv, s, h)


def auto_block_s(batch: int, n_kv: int, head_dim: int, s: int, multiple: int = 1) -> int:
  """Slots per block: the largest power of two whose float32 [B, K, block, H] fits L2_BLOCK_BYTES (at least
  MIN_BLOCK_S), rounded to `multiple`, at most S rounded up to `multiple`."""
  blk = MIN_BLOCK_S
  while 2 * blk * batch * n_kv * head_dim * 4 <= L2_BLOCK_BYTES:
    blk *= 2
  blk = max(multiple, blk // multiple * multiple)
  return min(blk, -(-s // multiple) * multiple)


def _blocked(s: int, blk: int, block_fn, init, accumulate: bool):
  """Runs block_fn(start, size) over [0, s) in blocks of blk (a loop) plus one static tail block; sums the
  results (accumulate) or writes each [..., size] result at `start` of the last axis of init."""
  n_full, tail = divmod(s, blk)

  def put(out, start, part):
    return out + part if accumulate else lax.dynamic_update_slice_in_dim(out, part, start, out.ndim - 1)

  out = init
  if n_full == 1:
    out = put(out, 0, block_fn(0, blk))
  elif n_full > 1:
    out = lax.fori_loop(0, n_full, lambda i, o: put(o, i * blk, block_fn(i * blk, blk)), out)
  if tail:
    out = put(out, n_full * blk, block_fn(n_full * blk, tail))
  return out


def value_sum(p_BKGTS, v_codes, v_scale, v_zero, *, bits: int, group_size: int, block_s: int | None = None):
  """Σ_s p_s · dequant(v_s): float32 [B, T, K, G, H].

  p [B, K, G, T, S] (probabilities, zero at masked slots); v_codes uint8 [B, K, S, C]; v_scale, v_zero
  [B, K, S, H/g]. block_s: slots per loop step (default `auto_block_s`).
  """
  b, n_kv, n_rep, t, s = p_BKGTS.shape
  h = v_scale.shape[3] * group_size
  _check(v_codes, v_scale, v_zero, bits, group_size, h, "value")
  if v_codes.shape[2] != s or v_scale.shape[2] != s:
    raise ValueError(f"value codes S={v_codes.shape[2]} / scale S={v_scale.shape[2]} must equal p's S={s}")
  blk = auto_block_s(b, n_kv, h, s) if block_s is None else block_s
  if blk <= 0:
    raise ValueError(f"block_s={blk} must be > 0")
  p_BKMS = p_BKGTS.reshape(b, n_kv, n_rep * t, s).astype(jnp.float32)

  def block_sum(start, size):
    codes = lax.dynamic_slice_in_dim(v_codes, start, size, 2)
    scale = lax.dynamic_slice_in_dim(v_scale, start, size, 2)
    zero = lax.dynamic_slice_in_dim(v_zero, start, size, 2)
    probs = lax.dynamic_slice_in_dim(p_BKMS, start, size, 3)
    return jnp.einsum("bkms,bksh->bkmh", probs, _dequant_values(codes, scale, zero, bits, group_size))

  out_BKMH = _blocked(s, blk, block_sum, jnp.zeros((b, n_kv, n_rep * t, h), jnp.float32), accumulate=True)
  return jnp.transpose(out_BKMH.reshape(b, n_kv, n_rep, t, h), (0, 3, 1, 2, 4))


def value_sum_reference(p_BKGTS, v_codes, v_scale, v_zero, *, bits: int, group_size: int):
  """float32 reference: dequantize every value with `quant`, then an einsum. [B, T, K, G, H]."""
  values_BKSH = quant.dequantize_values(quant.QuantizedValues(v_codes, v_scale, v_zero), bits, group_size)
  return jnp.einsum("bkgts,bksh->btkgh", p_BKGTS.astype(jnp.float32), values_BKSH)
