"""KIVI through the shared low-bit store: 8-bit is close to full; the window rules hold."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import dispatch
from specache_jax.caches import lowbit
from tests.tiny import random_prompts, tiny_model


def _logits_through(model, method, prompt, steps):
  from specache_jax.decode import init_cache
  from specache_jax.model.decoder import forward_jit as forward
  cfg, params = model.config, model.params
  toks = jnp.asarray([prompt])
  cache = init_cache(method, cfg, 1, method.slots(len(prompt) + steps + 4), jnp.float32)
  _, cache, _ = forward(params, cfg, toks[:, :len(prompt) - steps], cache, method, "prefill")
  out = []
  for t in range(len(prompt) - steps, len(prompt)):
    logits, cache, _ = forward(params, cfg, toks[:, t:t + 1], cache, method, "decode")
    out.append(logits[0, 0])
  return jnp.stack(out)


def test_ring_positions_hold_the_last_window():
  pos = lowbit.ring_positions(jnp.asarray([0, 3, 8, 11]), 4)
  assert pos.tolist() == [[-1, -1, -1, -1], [0, 1, 2, -1], [4, 5, 6, 7], [8, 9, 10, 7]]


@pytest.mark.parametrize("bits,group_size", [(1, 8), (2, 16), (4, 4)])
def test_ring_keys_below_key_qlen_are_the_last_window_dequantized(bits, group_size):
  """`ring_segment`'s keys: for a slot whose position p is below key_qlen, the low-bit key of p (from contiguous
  slices of the last flushed window); at or above it, the 16-bit ring key. Ragged rows: no window yet, a window
  just flushed (every slot low-bit), and mid-window."""
  rng = np.random.default_rng(bits)
  b, n_kv, residual, h, slots = 3, 2, 16, 16, 96
  qargs = dict(bits=bits, group_size=group_size, residual=residual, one_bit="specache")
  lengths = jnp.asarray([9, 48, 71], jnp.int32)
  k, v = (jnp.asarray(rng.standard_normal((b, n_kv, slots, h)), jnp.float32) for _ in range(2))
  st = lowbit.prefill(lowbit.init(b, n_kv, slots, h, bits, group_size, residual, jnp.float32), k, v, lengths,
                      **qargs)
  keys, _, pos = lowbit.ring_segment(st, lengths, bits=bits, group_size=group_size, residual=residual)
  low_keys, _ = lowbit.dequantized(st, bits=bits, group_size=group_size)
  key_qlen = np.asarray(lengths) // residual * residual
  pos = np.asarray(pos)
  for i in range(b):
    for s in range(residual):
      p = pos[i, 0, s]
      if p < 0:                                       # an empty slot (row 0 holds 9 positions)
        continue
      want = k[i, :, p] if p >= key_qlen[i] else low_keys[i, :, p]
      np.testing.assert_allclose(np.asarray(keys[i, :, s]), np.asarray(want), rtol=1e-6, atol=1e-6,
                                 err_msg=f"row {i} slot {s} position {p}")
  pos = pos[:, 0]
  assert (pos[0] < 0).sum() == residual - 9 and (pos[1] < key_qlen[1]).all()
  assert ((pos[2] >= 0) & (pos[2] < key_qlen[2])).any() and (pos[2] >= key_qlen[2]).any()


@pytest.mark.parametrize("t", [1, 3, 8, 11])
def test_storing_rows_codes_first_and_ring_after_equals_appending_them_one_by_one(t):
  """The steps store T rows' codes (`store_codes`: value codes, and key windows flushed from the ring with the
  rows put in) while the ring stays as it was, then write the ring (`store_ring`) after the attention read it:
  the same cache as T appends one after the other — on ragged rows (one wrapping past the ring's end, one at
  length 0), with windows filling at different rows (t = 11 > R rewrites ring slots within the step)."""
  rng = np.random.default_rng(t)
  b, n_kv, residual, h = 3, 2, 8, 16
  qargs = dict(bits=2, group_size=8, residual=residual, one_bit="kivi")
  st = lowbit.init(b, n_kv, 64, h, 2, 8, residual, jnp.float32)
  st = st.replace(ring_k=jnp.asarray(rng.standard_normal((b, n_kv, residual, h)), jnp.float32),
                  ring_v=jnp.asarray(rng.standard_normal((b, n_kv, residual, h)), jnp.float32))
  lengths = jnp.asarray([13, 0, 30], jnp.int32)
  k, v = (jnp.asarray(rng.standard_normal((b, n_kv, t, h)), jnp.float32) for _ in range(2))
  one_by_one = st
  for i in range(t):
    one_by_one = lowbit.append(one_by_one, k[:, :, i], v[:, :, i], lengths + i, **qargs)
  codes_only, _ = lowbit.store_codes(st, k, v, lengths, **qargs)
  np.testing.assert_array_equal(np.asarray(codes_only.ring_k), np.asarray(st.ring_k))
  together = lowbit.store_ring(codes_only, k, v, lengths, after=codes_only.k_codes)
  for name, a, e in zip(lowbit.LowBit.__dataclass_fields__, jax.tree.leaves(together), jax.tree.leaves(one_by_one)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
  flushed = bool(((np.asarray(lengths)[:, None] + np.arange(1, t + 1)[None, :]) % residual == 0).any())
  assert flushed == (t >= 3)              # the windows of rows 0 and 2 fill within 3 rows; row 1's at 8


def test_kivi_error_shrinks_with_bits_and_8_bit_is_close_to_full():
  model = tiny_model(seed=11, head_dim=16)
  prompt = random_prompts(1, [70], model.config.vocab_size)[0]
  ref = sj.forward(model, np.asarray([prompt]))[0, -30:]
  err = {}
  for bits in (8, 4, 2):
    method = sj.cache_config("kivi", bits=bits, group_size=8, residual=16)
    err[bits] = float(jnp.max(jnp.abs(_logits_through(model, method, prompt, 30) - ref)))
  # the step shrinks 17x from 4 to 8 bits and 5x from 2 to 4 bits; the logit error follows it
  assert err[8] < err[4] / 6 < err[2] / 12, err
  assert err[8] < 0.05 * float(jnp.max(jnp.abs(ref))), err


def test_kivi_with_residual_covering_everything_is_exact():
  model = tiny_model(seed=12, head_dim=16)
  prompt = random_prompts(2, [40], model.config.vocab_size)[0]
  ref = sj.forward(model, np.asarray([prompt]))[0, -20:]
  # R=64 > 40 tokens: nothing is ever quantized, KIVI equals the full cache.
  method = sj.cache_config("kivi", bits=1, group_size=8, residual=64)
  got = _logits_through(model, method, prompt, 20)
  np.testing.assert_allclose(got, ref, atol=1e-4)


def test_kivi_batched_ragged_equals_alone():
  model = tiny_model(seed=13, head_dim=16)
  prompts = random_prompts(3, [9, 30, 21], model.config.vocab_size)
  method = sj.cache_config("kivi", bits=2, group_size=8, residual=16)
  batched = sj.generate(model, prompts, max_new_tokens=20, cache=method, stop_tokens=())
  for i, p in enumerate(prompts):
    alone = sj.generate(model, [p], max_new_tokens=20, cache=method, stop_tokens=())
    np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])


@pytest.mark.parametrize("settings, match", [
    (dict(bits=3), "bits=3"), (dict(group_size=24, residual=64), "must divide residual"),
    (dict(one_bit="x"), "one_bit"), (dict(residual=0), "residual=0")])
def test_bad_kivi_configs(settings, match):
  with pytest.raises(ValueError, match=match):
    sj.cache_config("kivi", **settings)


def test_group_not_dividing_head_dim_fails_before_compiling():
  model = tiny_model(seed=0, head_dim=16)
  with pytest.raises(ValueError, match="must divide head_dim=16"):
    sj.generate(model, [[1, 2, 3]], cache=sj.cache_config("kivi", group_size=32, residual=64))


@pytest.mark.parametrize("bits,group_size", [(1, 16), (2, 8), (4, 16), (8, 4)])
def test_ring_keys_kernel_equals_its_reference(bits, group_size):
  """`cpu_kernels.ring_keys` (XLA:CPU) against its jnp reference on fresh random buffers: ragged lengths (none
  stored, mid-window, a window just flushed, past several windows), a scale large enough for q·scale + zero to
  overflow (the reference's halved form), and the lowering: the custom call on the CPU only."""
  from specache_jax import cpu_kernels as ck
  from specache_jax.cpu_kernels import ring_keys as rk
  if not ck.available():
    pytest.skip(f"CPU kernels {ck.status()}")
  rng = np.random.default_rng(10 * bits + group_size)
  b, n_kv, r, h, s = 5, 2, 16, 32, 80
  ring = jnp.asarray(rng.standard_normal((b, n_kv, r, h)), jnp.float32)
  codes = jnp.asarray(rng.integers(0, 256, (b, n_kv, s, h * bits // 8)), jnp.uint8)
  scale = rng.random((b, n_kv, s // group_size, h)).astype(np.float32)
  scale[3, 1, 3] = 3e38                                           # row 3's window: q·scale + zero overflows
  zero = rng.standard_normal((b, n_kv, s // group_size, h)).astype(np.float32)
  zero[3, 1, 3] = 3e38
  lengths = jnp.asarray([0, 7, 32, 61, 80], jnp.int32)
  args = (ring, codes, jnp.asarray(scale), jnp.asarray(zero), lengths)
  kw = dict(bits=bits, group_size=group_size)
  got = np.asarray(jax.jit(lambda *a: dispatch.ring_keys(*a, **kw))(*args))
  want = np.asarray(rk.ring_keys_reference(*args, **kw))
  assert got.shape == (b, n_kv, r, h) and np.isfinite(want[3]).all()
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got[1, :, :7], np.asarray(ring)[1, :, :7])       # 16-bit slots: the ring's rows
  cpu = jax.jit(lambda *a: dispatch.ring_keys(*a, **kw)).trace(*args).lower().as_text()
  gpu = jax.jit(lambda *a: dispatch.ring_keys(*a, **kw)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert ck.RING_KEYS_TARGET in cpu and ck.RING_KEYS_TARGET not in gpu
  with pytest.raises(ValueError, match="R=16 a multiple of group_size"):
    dispatch.ring_keys(*args, bits=bits, group_size=32)
