"""SpeCache (simulated): exact where it must be, the two-row step, what is stored, device bytes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax.caches import specache as sc
from specache_jax.decode import init_cache
from specache_jax.model.decoder import forward_jit as forward
from tests.tiny import random_prompts, tiny_model


def _model():
  return tiny_model(seed=21, head_dim=16)


def _decode_logits(model, method, prompt, n_prefill):
  """Prefill n_prefill tokens, pre-decode, then teacher-force the rest as real rows; logits of row 0."""
  cfg, params = model.config, model.params
  toks = jnp.asarray([prompt])
  cache = init_cache(method, cfg, 1, method.slots(len(prompt) + 4), jnp.float32)
  _, cache, _ = forward(params, cfg, toks[:, :n_prefill], cache, method, "prefill")
  out = []
  if method.speculation.predecodes:
    _, cache, _ = forward(params, cfg, toks[:, n_prefill:n_prefill + 1], cache, method, "predecode")
  for t in range(n_prefill, len(prompt)):
    spec = toks[:, min(t + 1, len(prompt) - 1)]
    inp = jnp.stack([toks[:, t], spec], 1) if method.speculation.width == 2 else toks[:, t:t + 1]
    logits, cache, _ = forward(params, cfg, inp, cache, method, "decode")
    out.append(logits[0, 0])
  return jnp.stack(out), cache


@pytest.mark.parametrize("bits,speculative", [(1, True), (2, True), (2, False)],
                         ids=lambda x: f"{x}")
def test_topk_covering_the_context_equals_full_attention(bits, speculative):
  model = _model()
  prompt = random_prompts(0, [60], model.config.vocab_size)[0]
  ref = sj.forward(model, np.asarray([prompt]))[0, 30:]
  method = sj.cache_config("specache", bits=bits, group_size=8, residual=8, topk=64, speculative=speculative)
  got, _ = _decode_logits(model, method, prompt, 30)
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_small_topk_differs_from_full_but_k0_is_the_low_bit_cache():
  model = _model()
  prompt = random_prompts(1, [60], model.config.vocab_size)[0]
  ref = sj.forward(model, np.asarray([prompt]))[0, 30:]
  spec0, _ = _decode_logits(model, sj.cache_config("specache", bits=2, group_size=8, residual=8, topk=0),
                            prompt, 30)
  kivi = sj.cache_config("kivi", bits=2, group_size=8, residual=8, one_bit="specache")
  from tests.test_kivi import _logits_through
  kivi_logits = _logits_through(model, kivi, prompt, 30)
  np.testing.assert_allclose(spec0, kivi_logits, atol=1e-4)       # k = 0: nothing fetched = KIVI (same R)
  spec8, _ = _decode_logits(model, sj.cache_config("specache", bits=2, group_size=8, residual=8, topk=8),
                            prompt, 30)
  err0 = float(jnp.max(jnp.abs(spec0 - ref)))
  err8 = float(jnp.max(jnp.abs(spec8 - ref)))
  assert 0 < err8 < err0, (err8, err0)


def test_real_row_ignores_the_speculative_token_and_only_it_is_stored():
  model = _model()
  cfg, params = model.config, model.params
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4)
  toks = jnp.asarray(random_prompts(2, [33], cfg.vocab_size))
  cache = init_cache(method, cfg, 1, 64, jnp.float32)
  _, cache, _ = forward(params, cfg, toks[:, :32], cache, method, "prefill")
  _, cache, _ = forward(params, cfg, toks[:, 32:33], cache, method, "predecode")
  a, ca, _ = forward(params, cfg, jnp.asarray([[5, 7]]), cache, method, "decode")
  b, cb, _ = forward(params, cfg, jnp.asarray([[5, 60]]), cache, method, "decode")
  np.testing.assert_allclose(a[:, 0], b[:, 0], atol=1e-6)
  assert not np.allclose(a[:, 1], b[:, 1])
  assert int(ca.lengths[0]) == 33
  # the stored state is identical except κ and the fetched rows (chosen by the speculative row)
  for name in ("low", "k16", "v16"):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), getattr(ca.layers, name),
                 getattr(cb.layers, name))
  # the 16-bit row written at position 32 is the real token's (layer 0: depends only on token 5 at 32)
  _, c_real, _ = forward(params, cfg, jnp.asarray([[5]]), cache, sj.cache_config("specache", bits=1,
                         group_size=8, residual=8, topk=4, speculative=False), "decode")
  np.testing.assert_allclose(ca.layers.k16[0, :, :, 32], c_real.layers.k16[0, :, :, 32], atol=1e-6)
  assert not np.any(np.asarray(ca.layers.k16[:, :, :, 33]))


def test_kappa_is_topk_of_group_mean_over_stored_positions():
  model = _model()
  cfg, params = model.config, model.params
  method = sj.cache_config("specache", bits=2, group_size=8, residual=8, topk=5)
  toks = jnp.asarray(random_prompts(3, [41], cfg.vocab_size))
  cache = init_cache(method, cfg, 1, 64, jnp.float32)
  _, cache, _ = forward(params, cfg, toks[:, :40], cache, method, "prefill")
  _, cache, _ = forward(params, cfg, toks[:, 40:41], cache, method, "predecode")
  kappa = np.asarray(cache.layers.kappa)                                  # [L, B, K, X]
  assert kappa.shape == (cfg.n_layers, 1, cfg.n_kv_heads, 5)
  assert kappa.max() < 40 and kappa.min() >= 0
  for row in kappa.reshape(-1, 5):
    assert len(set(row.tolist())) == 5
  # fetched rows are exactly the 16-bit rows at κ
  np.testing.assert_array_equal(
      cache.layers.fetched_k, jnp.take_along_axis(cache.layers.k16, cache.layers.kappa[..., None], axis=3))
  _, cache2, _ = forward(params, cfg, jnp.asarray([[3, 4]]), cache, method, "decode")
  assert int(np.asarray(cache2.layers.kappa).max()) <= 40                 # candidates 0..n, n = 40


def test_batched_ragged_generation_equals_alone():
  model = _model()
  prompts = random_prompts(4, [13, 40, 26], model.config.vocab_size)
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4)
  batched = sj.generate(model, prompts, max_new_tokens=16, cache=method, stop_tokens=())
  for i, p in enumerate(prompts):
    alone = sj.generate(model, [p], max_new_tokens=16, cache=method, stop_tokens=())
    np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])


def test_generation_with_large_topk_equals_full_and_reports_hit_rates():
  model = _model()
  prompts = random_prompts(5, [20, 31], model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=12, stop_tokens=())
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=64, track_hits=True)
  out, stats = sj.generate(model, prompts, max_new_tokens=12, cache=method, stop_tokens=(),
                           return_stats=True)
  np.testing.assert_array_equal(out.tokens, full.tokens)
  assert stats["topk_hit_rate"] == pytest.approx(1.0)
  assert 0.0 <= stats["exact_hit_rate"] <= 1.0
  small = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=2, track_hits=True)
  _, stats2 = sj.generate(model, prompts, max_new_tokens=12, cache=small, stop_tokens=(), return_stats=True)
  assert 0.0 <= stats2["topk_hit_rate"] < 1.0
  assert len(stats2["topk_hit_rate_per_layer"]) == model.config.n_layers


def _smollm2_shape(**kw):
  from specache_jax.model_config import ModelConfig
  return ModelConfig(architecture="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                     head_dim=64, ffn_dim=1536, max_position=8192)


@pytest.mark.parametrize("bits,limit", [(1, 0.12), (2, 0.18)])
def test_device_bytes_ratio_at_8k_on_smollm2_shape(bits, limit):
  cfg = _smollm2_shape()
  full = sj.cache_config("full")
  spec = sj.cache_config("specache", bits=bits, group_size=64, residual=64, topk=64, offload=True)
  st_full = jax.eval_shape(lambda: full.impl.init(full, cfg, 1, 8192, jnp.bfloat16))
  st_spec = jax.eval_shape(lambda: spec.impl.init(spec, cfg, 1, 8192, jnp.bfloat16))
  nbytes = lambda t: sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(t))
  ratio = nbytes(st_spec) / nbytes(st_full)
  # formula: b + 32/g bits per element over 16, plus (k + R) 16-bit rows of 8192
  formula = (bits + 32 / 64) / 16 + (64 + 64) / 8192
  assert ratio == pytest.approx(formula, rel=0.02)
  assert ratio <= limit


@pytest.mark.parametrize("settings, match", [
    (dict(bits=3), "bits=3"), (dict(group_size=48, residual=64), "must divide residual"),
    (dict(topk=-1), "topk=-1"), (dict(attention_impl="cuda"), "attention_impl"),
    (dict(one_bit="sign"), "one_bit")])
def test_bad_specache_configs(settings, match):
  with pytest.raises(ValueError, match=match):
    sj.cache_config("specache", **settings)


def test_topk_larger_than_the_cache_fails_before_compiling():
  model = _model()
  with pytest.raises(ValueError, match="larger than the cache"):
    sj.generate(model, [[1, 2, 3]], max_new_tokens=4,
                cache=sj.cache_config("specache", group_size=8, residual=8, topk=1000))


@pytest.mark.parametrize("options", [{}, dict(exact_ring=True, skip_ring=True),
                                     dict(lowbit_in_output=False, exact_on_miss=True)])
def test_pallas_interpret_attention_gives_the_same_tokens_as_jnp(options):
  """The GPU kernel's contract (interpreted) against the jnp/CPU path; exact_ring hands it the ring's 16-bit keys;
  lowbit_in_output=False + exact_on_miss: the kernels' outputs without the low-bit values (lowbit_values=False)."""
  model = _model()
  prompts = random_prompts(9, [22, 37], model.config.vocab_size)
  kw = dict(bits=2, group_size=8, residual=8, topk=4, **options)
  ref = sj.generate(model, prompts, max_new_tokens=10, stop_tokens=(),
                    cache=sj.cache_config("specache", **kw))
  got = sj.generate(model, prompts, max_new_tokens=10, stop_tokens=(),
                    cache=sj.cache_config("specache", attention_impl="pallas_interpret", **kw))
  np.testing.assert_array_equal(got.tokens, ref.tokens)


def test_exact_on_miss_refetches_when_speculation_fails_and_offload_agrees():
  model = _model()
  prompts = random_prompts(10, [30, 44], model.config.vocab_size)
  kw = dict(bits=1, group_size=8, residual=8, topk=4, exact_on_miss=True)
  sim, stats = sj.generate(model, prompts, max_new_tokens=16, stop_tokens=(), return_stats=True,
                           cache=sj.cache_config("specache", **kw))
  plain = sj.generate(model, prompts, max_new_tokens=16, stop_tokens=(),
                      cache=sj.cache_config("specache", **dict(kw, exact_on_miss=False)))
  assert stats["exact_hit_rate"] < 1.0                       # random tiny model: speculation misses
  assert not np.array_equal(sim.tokens, plain.tokens)        # and the exact fetch changes what is attended
  off = sj.generate(model, prompts, max_new_tokens=16, stop_tokens=(),
                    cache=sj.cache_config("specache", offload=True, **kw))
  np.testing.assert_array_equal(off.tokens, sim.tokens)


@pytest.mark.parametrize("s,k,block", [(1000, 16, 64), (4096, 64, 512), (300, 8, 512), (257, 32, 16),
                                       (2048, 64, 64)])
def test_blocked_top_k_is_lax_top_k_exactly_including_ties(s, k, block):
  """The per-block top-k then top-k of the candidates returns lax.top_k's indices, in its order, also with
  many equal scores (masked slots are all -1) and a ragged last block."""
  from specache_jax.caches.selection import top_k_indices
  rng = np.random.default_rng(s + k)
  scores = rng.integers(0, 7, size=(2, 3, s)).astype(np.float32) / 7.0      # heavy ties
  scores[0, :, s // 3:] = -1.0                                              # a masked tail, as `select` does
  scores[1, 1] = rng.standard_normal(s)
  got = np.asarray(top_k_indices(jnp.asarray(scores), k, block))
  want = np.asarray(jax.lax.top_k(jnp.asarray(scores), k)[1])
  np.testing.assert_array_equal(got, want)
