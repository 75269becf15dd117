"""caches.packed: low-bit attention over packed codes == dequantize-then-einsum, and no [B,K,S,H] float32."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specache_jax.caches import attention as A
from specache_jax.caches import lowbit
from specache_jax.caches import packed

TOL = 1e-5   # max |out - ref| / max |ref|


def _rel_err(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.all(np.isfinite(out))
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _random_keys(rng, b, k, s, h, bits, g, dtype=jnp.float32):
  codes = jnp.asarray(rng.integers(0, 256, (b, k, s, h * bits // 8)), jnp.uint8)
  scale = jnp.asarray(rng.uniform(0.0, 2.0, (b, k, s // g, h)), dtype)
  zero = jnp.asarray(rng.normal(0.0, 3.0, (b, k, s // g, h)), dtype)
  return codes, scale, zero


def _random_values(rng, b, k, s, h, bits, g, dtype=jnp.float32):
  codes = jnp.asarray(rng.integers(0, 256, (b, k, s, h * bits // 8)), jnp.uint8)
  scale = jnp.asarray(rng.uniform(0.0, 2.0, (b, k, s, h // g)), dtype)
  zero = jnp.asarray(rng.normal(0.0, 3.0, (b, k, s, h // g)), dtype)
  return codes, scale, zero


def _maybe_jit(fn, use_jit, **static):
  f = functools.partial(fn, **static)
  return jax.jit(f) if use_jit else f


KEY_CASES = [  # (bits, group_size, S, H)
    (1, 64, 256, 64), (1, 16, 96, 32), (2, 64, 192, 64), (2, 8, 40, 16),
    (4, 32, 128, 32), (4, 16, 48, 64), (8, 32, 96, 32), (8, 8, 24, 16),
]


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("bits,group_size,s,h", KEY_CASES,
                         ids=[f"bits={b}_g={g}_S={s}_H={h}" for b, g, s, h in KEY_CASES])
def test_key_logits_matches_reference(bits, group_size, s, h, use_jit):
  rng = np.random.default_rng(bits * 1000 + s)
  b, k, g_rep, t = 2, 3, 3, 2
  q = jnp.asarray(rng.normal(size=(b, t, k, g_rep, h)), jnp.float32)
  codes, scale, zero = _random_keys(rng, b, k, s, h, bits, group_size)
  ref = packed.key_logits_reference(q, codes, scale, zero, bits=bits, group_size=group_size)
  assert ref.shape == (b, k, g_rep, t, s)
  for fn in (packed.key_logits, packed.key_logits_blocked):
    out = _maybe_jit(fn, use_jit, bits=bits, group_size=group_size)(q, codes, scale, zero)
    assert _rel_err(out, ref) <= TOL, fn.__name__


VALUE_CASES = [  # (bits, group_size, S, H, block_s): S a multiple of the block, ragged tails, one block
    (1, 64, 256, 64, None), (1, 16, 300, 32, 128), (2, 64, 200, 64, 64), (2, 8, 77, 16, None),
    (4, 32, 130, 32, 128), (4, 16, 64, 64, 64), (8, 32, 333, 32, 100), (8, 8, 5, 16, None),
]


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("bits,group_size,s,h,block_s", VALUE_CASES,
                         ids=[f"bits={b}_g={g}_S={s}_H={h}_block={bl}" for b, g, s, h, bl in VALUE_CASES])
def test_value_sum_matches_reference(bits, group_size, s, h, block_s, use_jit):
  rng = np.random.default_rng(bits * 1000 + s + 7)
  b, k, g_rep, t = 2, 3, 3, 2
  p = jax.nn.softmax(jnp.asarray(rng.normal(0.0, 2.0, (b, k, g_rep, t, s)), jnp.float32), axis=-1)
  codes, scale, zero = _random_values(rng, b, k, s, h, bits, group_size)
  ref = packed.value_sum_reference(p, codes, scale, zero, bits=bits, group_size=group_size)
  assert ref.shape == (b, t, k, g_rep, h)
  out = _maybe_jit(packed.value_sum, use_jit, bits=bits, group_size=group_size, block_s=block_s)(
      p, codes, scale, zero)
  assert _rel_err(out, ref) <= TOL


@pytest.mark.parametrize("block_s", [32, 64, 96, 1024])
def test_key_logits_blocked_ragged_tail(block_s):
  rng = np.random.default_rng(block_s)
  bits, g, s, h = 2, 32, 320, 32                        # 320 = 3 blocks of 96 + a tail of 32, etc.
  q = jnp.asarray(rng.normal(size=(1, 1, 2, 4, h)), jnp.float32)
  codes, scale, zero = _random_keys(rng, 1, 2, s, h, bits, g)
  ref = packed.key_logits_reference(q, codes, scale, zero, bits=bits, group_size=g)
  out = jax.jit(functools.partial(packed.key_logits_blocked, bits=bits, group_size=g, block_s=block_s))(
      q, codes, scale, zero)
  assert _rel_err(out, ref) <= TOL


def test_bfloat16_inputs():
  """bfloat16 query / probabilities and storage: same float32 math as the references."""
  rng = np.random.default_rng(5)
  bits, g, s, h = 2, 32, 128, 64
  q = jnp.asarray(rng.normal(size=(1, 2, 2, 2, h)), jnp.bfloat16)
  kc, ks, kz = _random_keys(rng, 1, 2, s, h, bits, g, jnp.bfloat16)
  assert _rel_err(packed.key_logits(q, kc, ks, kz, bits=bits, group_size=g),
                  packed.key_logits_reference(q, kc, ks, kz, bits=bits, group_size=g)) <= TOL
  p = jax.nn.softmax(jnp.asarray(rng.normal(size=(1, 2, 2, 2, s)), jnp.float32), -1).astype(jnp.bfloat16)
  vc, vs, vz = _random_values(rng, 1, 2, s, h, bits, g, jnp.bfloat16)
  assert _rel_err(packed.value_sum(p, vc, vs, vz, bits=bits, group_size=g),
                  packed.value_sum_reference(p, vc, vs, vz, bits=bits, group_size=g)) <= TOL


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_attention_over_a_ragged_lowbit_cache(bits):
  """Masked softmax attention built from key_logits / value_sum over a prefilled LowBit (ragged lengths,
  unused slots filled with garbage) == segmented_attention over the dequantized copy."""
  rng = np.random.default_rng(bits)
  b, k, g_rep, t, h, g, r, slots = 3, 2, 3, 2, 32, 16, 32, 192
  lengths = jnp.asarray([192, 70, 5], jnp.int32)
  st = lowbit.init(b, k, slots, h, bits, g, r, jnp.float32)
  kk = jnp.asarray(rng.normal(size=(b, k, slots, h)), jnp.float32)
  vv = jnp.asarray(rng.normal(size=(b, k, slots, h)), jnp.float32)
  st = lowbit.prefill(st, kk, vv, lengths, bits=bits, group_size=g, residual=r, one_bit="specache")
  used = (jnp.arange(slots)[None, :] < lengths[:, None])[:, None, :, None]          # [B, 1, S, 1]
  st = st.replace(k_codes=jnp.where(used, st.k_codes, jnp.uint8(0xA5)),
                  v_codes=jnp.where(used, st.v_codes, jnp.uint8(0x5A)),
                  v_scale=jnp.where(used, st.v_scale, 1e4), v_zero=jnp.where(used, st.v_zero, -1e4))
  q = jnp.asarray(rng.normal(size=(b, t, k * g_rep, h)), jnp.float32)
  mask = jnp.broadcast_to(A.valid_cols_mask(lengths, slots, t), (b, k, t, slots))
  sm_scale = h ** -0.5

  keys, values = lowbit.dequantized(st, bits=bits, group_size=g)
  ref, _ = A.segmented_attention(q, [(keys, values, mask)], sm_scale, k)

  @jax.jit
  def packed_attention(q, st):
    logits = packed.key_logits(A.split_heads(q, k), st.k_codes, st.k_scale, st.k_zero, bits=bits,
                               group_size=g) * sm_scale
    p = jax.nn.softmax(jnp.where(mask[:, :, None], logits, A.MASKED), axis=-1)
    out = packed.value_sum(p, st.v_codes, st.v_scale, st.v_zero, bits=bits, group_size=g, block_s=64)
    return out.reshape(q.shape)

  assert _rel_err(packed_attention(q, st), ref) <= TOL


def _big_f32_buffers(hlo_text: str, n_elements: int):
  """f32 array shapes in an HLO text with at least n_elements elements."""
  big = []
  for dims in re.findall(r"f32\[([\d,]*)\]", hlo_text):
    size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    if size >= n_elements:
      big.append(dims)
  return big


def test_no_dequantized_cache_in_the_compiled_program():
  """At the decode shape (SmolLM2: K=3, G=3, H=64, T=2; S=8192, 1-bit, g=64) neither function has a float32
  buffer of B*K*S*H elements, and XLA's temporaries stay far below its size."""
  b, t, k, g_rep, h, s, bits, g = 1, 2, 3, 3, 64, 8192, 1, 64
  full = b * k * s * h
  q = jax.ShapeDtypeStruct((b, t, k, g_rep, h), jnp.float32)
  p = jax.ShapeDtypeStruct((b, k, g_rep, t, s), jnp.float32)
  codes = jax.ShapeDtypeStruct((b, k, s, h * bits // 8), jnp.uint8)
  kgrp = jax.ShapeDtypeStruct((b, k, s // g, h), jnp.float32)
  vgrp = jax.ShapeDtypeStruct((b, k, s, h // g), jnp.float32)
  for fn, args in ((packed.key_logits, (q, codes, kgrp, kgrp)), (packed.value_sum, (p, codes, vgrp, vgrp))):
    compiled = jax.jit(functools.partial(fn, bits=bits, group_size=g)).lower(*args).compile()
    assert _big_f32_buffers(compiled.as_text(), full) == [], fn.__name__
    mem = compiled.memory_analysis()
    if mem is not None:
      assert mem.temp_size_in_bytes < full * 4 // 4, (fn.__name__, mem.temp_size_in_bytes)
  # the check itself: the reference does build it
  ref = jax.jit(functools.partial(packed.key_logits_reference, bits=bits, group_size=g)).lower(
      q, codes, kgrp, kgrp).compile()
  assert _big_f32_buffers(ref.as_text(), full)


def test_auto_block_s():
  assert packed.auto_block_s(1, 3, 64, 8192) == 1024
  assert packed.auto_block_s(4, 3, 64, 8192) == 256
  assert packed.auto_block_s(1, 3, 64, 100) == 100
  assert packed.auto_block_s(1, 3, 64, 100, multiple=64) == 128
  assert packed.auto_block_s(1, 3, 64, 8192, multiple=96) == 960


def test_bad_inputs_name_the_values():
  q = jnp.zeros((1, 1, 1, 1, 64))
  codes, scale, zero = _random_keys(np.random.default_rng(0), 1, 1, 64, 64, 2, 32)
  with pytest.raises(ValueError, match="bits=3"):
    packed.key_logits(q, codes, scale, zero, bits=3, group_size=32)
  with pytest.raises(ValueError, match="C=16"):
    packed.key_logits(q, codes, scale, zero, bits=1, group_size=32)
  with pytest.raises(ValueError, match="group_size=16"):
    packed.key_logits(q, codes, scale, zero, bits=2, group_size=16)
  with pytest.raises(ValueError, match="block_s=48"):
    packed.key_logits_blocked(q, codes, scale, zero, bits=2, group_size=32, block_s=48)
