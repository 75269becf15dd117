"""The XLA:CPU attention kernels against their float32 jnp references: the mixed-precision one
(`pallas_kernels.mixed_decode_attention_reference`, SpeCache's and KIVI's decoding steps through it) and the full
cache's dense decode attention (`cpu_kernels.dense_attention`)."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from pallas_kernels import testing
from pallas_kernels.mixed_decode_attention import mixed_decode_attention_reference
from specache_jax import cpu_kernels as ck
from specache_jax.cpu_kernels import dense_attention as ckd
from specache_jax.cpu_kernels import mixed_attention as cka
from specache_jax.model import decoder
from tests.tiny import random_prompts, tiny_model

needs_kernel = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels {ck.status()}")

LAYOUTS = [(1, 64, 64), (1, 128, 32), (1, 32, 16), (1, 64, 4), (2, 16, 8), (2, 64, 64), (2, 128, 32), (4, 32, 32),
           (8, 64, 16)]


def _compare(args, bits, group_size, sm_scale=0.3, **extra):
  kw = dict(bits=bits, group_size=group_size, sm_scale=sm_scale, **extra)
  got = jax.jit(functools.partial(cka.mixed_decode_attention, **kw))(*args)
  want = mixed_decode_attention_reference(*args, **kw)
  for name, g, w in zip(("out", "lowbit_probs", "extra_probs"), got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and np.isfinite(g).all(), name
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * max(float(np.abs(w).max()), 1e-3), err_msg=name)
  return got


@needs_kernel
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("bits,head_dim,group_size", LAYOUTS, ids=lambda x: str(x))
def test_kernel_matches_reference(bits, head_dim, group_size, t):
  """Fresh random caches poisoned past their lengths (NaN scales), ragged lengths across chunk boundaries (1024
  slots) and not multiples of g or 16, duplicated and out-of-range exclusions, random extra masks."""
  seed = 100 * bits + head_dim + 7 * group_size + t
  slots = 2500 + 3 * group_size
  args = testing.mixed_inputs(seed, batch=3, t=t, kv_heads=2, gqa=3, slots=slots, head_dim=head_dim, bits=bits,
                              group_size=group_size, lengths=[slots - 5, 1031, 17], n_exclude=9, n_extra=21)
  _compare(args, bits, group_size)


@needs_kernel
@pytest.mark.parametrize("bits,prob_rows", [(1, 2), (1, 3), (2, 1), (4, 2)])
def test_kernel_returns_the_last_rows_probabilities(bits, prob_rows):
  """prob_rows=P: each of the last P rows' probabilities ([B, K, P, S] and [B, K, P, E]) as the reference's; the
  last of them is what prob_rows=None returns. T = 3 (SpeCache's real row and two candidates)."""
  args = testing.mixed_inputs(40 + bits + prob_rows, batch=2, t=3, kv_heads=2, gqa=3, slots=1500, head_dim=64,
                              bits=bits, group_size=64, lengths=[1500, 611], n_exclude=7, n_extra=12)
  out, p_low, p_extra = _compare(args, bits, 64, prob_rows=prob_rows)
  assert p_low.shape == (2, 2, prob_rows, 1500) and p_extra.shape == (2, 2, prob_rows, 12)
  _, last_low, last_extra = _compare(args, bits, 64)
  np.testing.assert_array_equal(np.asarray(p_low[:, :, -1]), np.asarray(last_low))
  np.testing.assert_array_equal(np.asarray(p_extra[:, :, -1]), np.asarray(last_extra))
  with pytest.raises(ValueError, match=r"prob_rows=4 must be None or an int in \[1, T=3\]"):
    cka.mixed_decode_attention(*args, bits=bits, group_size=64, sm_scale=0.3, prob_rows=4)


@needs_kernel
@pytest.mark.parametrize("bits,head_dim,group_size,t", [(1, 64, 64, 3), (2, 32, 8, 1), (4, 64, 16, 2)])
def test_kernel_without_lowbit_values_scores_alike_and_outputs_the_extra_columns_softmax(bits, head_dim,
                                                                                        group_size, t):
  """lowbit_values=False (SpeCache's lowbit_in_output=False): the probabilities as with the values, the output the
  reference's softmax over the extra columns alone — and the low-bit values never read (NaN values and value
  scales everywhere change nothing). One row's extra columns all masked: output 0 there."""
  args = list(testing.mixed_inputs(60 + bits + t, batch=2, t=t, kv_heads=2, gqa=3, slots=1300, head_dim=head_dim,
                                   bits=bits, group_size=group_size, lengths=[1300, 517], n_exclude=5, n_extra=14))
  mask = np.asarray(args[11]).copy()
  mask[1, 1, t - 1] = False
  args[11] = jnp.asarray(mask)
  out, p_low, p_extra = _compare(args, bits, group_size, prob_rows=t, lowbit_values=False)
  _, with_low, with_extra = _compare(args, bits, group_size, prob_rows=t)
  np.testing.assert_array_equal(np.asarray(p_low), np.asarray(with_low))
  np.testing.assert_array_equal(np.asarray(p_extra), np.asarray(with_extra))
  assert not np.asarray(out)[1, t - 1, 3:].any() and np.asarray(out)[1, t - 1, :3].any()   # heads of KV head 1
  poisoned = list(args)
  poisoned[4] = jnp.full_like(args[4], 255)
  poisoned[5], poisoned[6] = jnp.full_like(args[5], jnp.nan), jnp.full_like(args[6], jnp.nan)
  got = jax.jit(functools.partial(cka.mixed_decode_attention, bits=bits, group_size=group_size, sm_scale=0.3,
                                  prob_rows=t, lowbit_values=False))(*poisoned)
  for g, w in zip(got, (out, p_low, p_extra)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(ValueError, match="lowbit_values=1 must be a bool"):
    cka.mixed_decode_attention(*args, bits=bits, group_size=group_size, sm_scale=0.3, lowbit_values=1)


@needs_kernel
def test_kernel_rows_with_nothing_to_attend_give_zeros():
  """lowbit_len 0 and no extra column for some rows: output 0 and probabilities 0, never NaN (as the reference)."""
  args = list(testing.mixed_inputs(3, batch=2, t=2, kv_heads=2, gqa=2, slots=96, head_dim=32, bits=1, group_size=16,
                                   lengths=[0, 40], n_exclude=3, n_extra=5))
  mask = np.asarray(args[11]).copy()
  mask[0] = False                                            # sequence 0: nothing at all
  mask[1, 0, 1] = False                                      # sequence 1, head 0, last row: low-bit columns only
  args[11] = jnp.asarray(mask)
  out, p_low, p_extra = _compare(args, 1, 16)
  assert not np.asarray(out)[0].any() and not np.asarray(p_low)[0].any() and not np.asarray(p_extra)[0].any()
  np.testing.assert_allclose(np.asarray(p_low)[1, 0].sum(), 1.0, rtol=1e-5)


@needs_kernel
def test_kernel_names_bad_inputs():
  args = list(testing.mixed_inputs(0, batch=1, t=2, kv_heads=1, gqa=2, slots=64, head_dim=32, bits=1, group_size=16,
                                   lengths=[40], n_exclude=2, n_extra=3))
  call = functools.partial(cka.mixed_decode_attention, bits=1, group_size=16, sm_scale=1.0)
  with pytest.raises(ValueError, match="head_dim=48 is not a layout it takes"):
    cka.mixed_decode_attention(jnp.ones((1, 2, 2, 48)), *args[1:], bits=1, group_size=16, sm_scale=1.0)
  with pytest.raises(ValueError, match=r"v_scale.shape=\(1, 1, 63, 2\) must be \[B, K, S, H/g\]"):
    call(*args[:5], args[5][:, :, :63], *args[6:])
  with pytest.raises(ValueError, match=r"extra_mask .*dtype=int32.* must be bool"):
    call(*args[:11], args[11].astype(jnp.int32))
  with pytest.raises(ValueError, match=r"lowbit_len .* must be int \[B=1\]"):
    call(*args[:7], jnp.zeros((2,), jnp.int32), *args[8:])
  with pytest.raises(ValueError, match="split alike"):
    call(*args[:9], [args[9][:, :, :1], args[9][:, :, 1:]], args[10], args[11])
  assert not cka.supports(1, 8, 16) and cka.supports(2, 8, 16) and not cka.supports(1, 48, 48)


@needs_kernel
@pytest.mark.parametrize("splits", [(21,), (8, 13), (5, 0, 16), (0, 21, 0), (3, 4, 5, 9)])
def test_kernel_reads_extra_segments_as_their_concatenation(splits):
  """extra_k / extra_v as segments [B, K, E_i, H] (empty ones, more than the kernel's three): the same results as
  the one concatenated array, exactly (the columns are scored and summed in the same order)."""
  args = testing.mixed_inputs(11 + len(splits), batch=2, t=2, kv_heads=2, gqa=3, slots=700, head_dim=64, bits=1,
                              group_size=64, lengths=[700, 333], n_exclude=5, n_extra=21)
  cuts = np.cumsum(splits)[:-1]
  seg = lambda x: [jnp.asarray(p) for p in np.split(np.asarray(x), cuts, axis=2)]
  kw = dict(bits=1, group_size=64, sm_scale=0.2, prob_rows=2)
  whole = jax.jit(functools.partial(cka.mixed_decode_attention, **kw))(*args)
  parts = jax.jit(functools.partial(cka.mixed_decode_attention, **kw))(*args[:9], seg(args[9]), seg(args[10]),
                                                                       args[11])
  for name, w, g in zip(("out", "lowbit_probs", "extra_probs"), whole, parts):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def _specache(**kw):
  return sj.cache_config("specache", **dict(dict(bits=1, group_size=16, residual=16, topk=8), **kw))


def _kernel_off():
  """A context for tracing with the CPU kernels off."""
  class Off:
    def __enter__(self):
      os.environ[ck.ENV_SWITCH] = "0"
      ck._load.cache_clear()

    def __exit__(self, *exc):
      os.environ.pop(ck.ENV_SWITCH, None)
      ck._load.cache_clear()
  return Off()


@needs_kernel
@pytest.mark.parametrize("name,bits", [("specache", 1), ("specache", 2), ("kivi", 2), ("full", None),
                                       ("candidates", 1), ("scoreonly", 1)])
def test_decode_step_takes_the_kernel_and_equals_xla(name, bits):
  """A decoding step (two sequences, ragged; SpeCache simulated — faithful, two candidates: the kernel gives
  several rows' probabilities —, scoreonly: the output and exact_on_miss's real-row scores without
  the low-bit values —, KIVI: the mixed kernel; the full cache: the dense one) with the
  kernel and with the jnp ops: the same logits and cache (SpeCache's κ included); lowered for a GPU the kernel is
  not emitted."""
  model = tiny_model(seed=8, head_dim=32)
  cfg = model.config
  method = {"specache": lambda: _specache(bits=bits), "full": lambda: sj.cache_config("full"),
            "candidates": lambda: _specache(bits=bits, candidates=2),
            "scoreonly": lambda: _specache(bits=bits, candidates=2, exact_on_miss=True, lowbit_in_output=False),
            "kivi": lambda: sj.cache_config("kivi", bits=bits, group_size=16, residual=16)}[name]()
  target = ck.DENSE_TARGET if name == "full" else ck.ATTENTION_TARGET
  prompts = random_prompts(2, [70, 45], cfg.vocab_size)
  tokens = jnp.asarray([p + [0] * (70 - len(p)) for p in prompts], jnp.int32)
  cache = sj.decode.init_cache(method, cfg, 2, method.slots(96), jnp.float32)
  _, cache, _ = decoder.forward_jit(model.params, cfg, tokens, cache, method, "prefill",
                                    jnp.asarray([70, 45], jnp.int32))
  if method.speculation.predecodes:
    _, cache, _ = decoder.forward_jit(model.params, cfg, jnp.asarray([[3], [4]]), cache, method, "predecode")
  if name == "scoreonly":                              # row 1's speculative token missed: its κ_t from its scores
    miss = jnp.asarray([False, True])
    cache = cache.replace(layers=cache.layers.replace(miss=jnp.broadcast_to(miss, cache.layers.miss.shape)))
  step = jnp.asarray([[3, 7, 2], [4, 1, 9]], jnp.int32)[:, :method.speculation.width]

  def run(x, c):
    return decoder.forward(model.params, cfg, x, c, method, "decode")[:2]

  with_kernel = jax.jit(run)
  assert target in with_kernel.trace(step, cache).lower().as_text()
  lowered_gpu = jax.jit(run).trace(step, cache).lower(lowering_platforms=("cuda",)).as_text()
  assert target not in lowered_gpu
  without = jax.jit(lambda x, c: run(x, c))
  with _kernel_off():
    assert target not in without.trace(step, cache).lower().as_text()
    want = without(step, cache)
  got = with_kernel(step, cache)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # float32, two summation orders: 1e-5 of the leaf's largest magnitude (logits up to ~5: 1.4e-5 seen on a
    # logit of -0.04 when XLA's own code is compiled at -O0, tests/conftest.py)
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max(initial=0.0))))


@needs_kernel
def test_kernel_path_generation_equals_full_when_k_covers_the_context_and_offload_agrees():
  """Through the kernel: k >= n gives the full cache's tokens; offloaded gives the simulated path's tokens
  (greedy, ragged batch)."""
  model = tiny_model(seed=9, head_dim=32)
  prompts = random_prompts(6, [40, 23, 57], model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=10, stop_tokens=())
  big = sj.generate(model, prompts, max_new_tokens=10, cache=_specache(topk=96), stop_tokens=())
  np.testing.assert_array_equal(big.tokens, full.tokens)
  sim = sj.generate(model, prompts, max_new_tokens=10, cache=_specache(), stop_tokens=())
  off = sj.generate(model, prompts, max_new_tokens=10, cache=_specache(offload=True), stop_tokens=())
  np.testing.assert_array_equal(off.tokens, sim.tokens)


@needs_kernel
def test_kernel_on_a_mesh_keeps_the_batch_sharded():
  """custom_partitioning: the batch axis stays on "data", the rest is gathered; the numbers are unchanged."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from specache_jax import sharding
  mesh = sharding.make_mesh(2, 2)
  args = testing.mixed_inputs(4, batch=4, t=2, kv_heads=2, gqa=2, slots=80, head_dim=32, bits=1, group_size=16,
                              lengths=[80, 33, 5, 61], n_exclude=4, n_extra=6)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))
  kw = dict(bits=1, group_size=16, sm_scale=0.5)
  fn = jax.jit(functools.partial(cka.mixed_decode_attention, **kw))
  sharded = [put(x) for x in args]
  assert ck.ATTENTION_TARGET in fn.lower(*sharded).compile().as_text()
  got = fn(*sharded)
  want = mixed_decode_attention_reference(*args, **kw)
  assert got[0].sharding.spec[0] == "data" and got[1].sharding.spec[0] == "data"
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-5 * float(np.abs(w).max()))


# ----- the full cache's dense decode attention (cpu_kernels/dense_attention.py) -----

@needs_kernel
@pytest.mark.parametrize("b,t,n,kh,s,h,limits", [
    (1, 1, 9, 3, 1300, 64, [1300]),                 # every slot, across the 512-slot chunks
    (3, 2, 9, 3, 1100, 64, [0, 513, 1099]),         # ragged; row 1 of sequence 0 sees slot 0 only
    (2, 4, 8, 2, 40, 32, [37, 5]),
    (2, 1, 4, 4, 700, 128, [600, 1]),
    (2, 3, 6, 3, 17, 16, [15, 3]),
])
def test_dense_kernel_matches_reference(b, t, n, kh, s, h, limits):
  """Fresh random caches poisoned (NaN) past the last slot any row may see: never read."""
  rng = np.random.default_rng(s + 7 * t + h)
  q = jnp.asarray(rng.standard_normal((b, t, n, h), np.float32))
  k, v = (rng.standard_normal((b, kh, s, h)).astype(np.float32) for _ in range(2))
  for i, lim in enumerate(limits):
    k[i, :, lim + t - 1:] = np.nan
    v[i, :, lim + t - 1:] = np.nan
  limit = jnp.asarray(limits, jnp.int32)
  got = jax.jit(lambda *a: ckd.decode_attention(*a, 0.3))(q, jnp.asarray(k), jnp.asarray(v), limit)
  want = ckd.decode_attention_reference(q, jnp.asarray(np.nan_to_num(k)), jnp.asarray(np.nan_to_num(v)), limit, 0.3)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5 * float(np.abs(want).max()))


@needs_kernel
def test_dense_kernel_rows_that_see_nothing_give_zeros_and_bad_inputs_are_named():
  q, kv = jnp.ones((2, 1, 4, 32)), jnp.ones((2, 2, 8, 32))
  out = ckd.decode_attention(q, kv, kv, jnp.asarray([0, 3], jnp.int32), 1.0)
  assert not np.asarray(out)[0].any() and np.allclose(np.asarray(out)[1], 1.0)
  with pytest.raises(ValueError, match=r"limit must be \[B=2\]"):
    ckd.decode_attention(q, kv, kv, jnp.asarray([3], jnp.int32), 1.0)
  with pytest.raises(ValueError, match="query heads must be a multiple of K=3"):
    ckd.decode_attention(q, jnp.ones((2, 3, 8, 32)), jnp.ones((2, 3, 8, 32)), jnp.asarray([1, 1]), 1.0)
  with pytest.raises(ValueError, match="cache bfloat16, head_dim=32, 2 query rows per KV head"):
    ckd.decode_attention(q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), jnp.asarray([1, 1]), 1.0)
  assert not ckd.supports(jnp.float32, 24, 3) and not ckd.supports(jnp.float32, 64, 65) and ckd.supports(
      jnp.float32, 64, 64)
