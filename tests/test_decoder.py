"""The decoder through the full cache equals the cache-free forward; batching equals running alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import decode
from specache_jax.caches import cache_config
from specache_jax.decode import init_cache
from specache_jax.model import decoder
from specache_jax.model.decoder import forward_full
from specache_jax.model.decoder import forward_jit as forward
from tests.tiny import random_prompts, tiny_model


@pytest.mark.parametrize("n_kv", [1, 2, 6], ids=lambda k: f"n_kv={k}")
def test_prefill_then_decode_equals_cache_free_forward(n_kv):
  model = tiny_model(seed=1, n_kv_heads=n_kv)
  cfg, params = model.config, model.params
  toks = jnp.asarray(random_prompts(0, [24], cfg.vocab_size))
  ref = forward_full(params, cfg, toks)                                     # [1, 24, V]
  method = cache_config("full")
  cache = init_cache(method, cfg, 1, 64, jnp.float32)
  logits, cache, _ = forward(params, cfg, toks[:, :10], cache, method, "prefill")
  np.testing.assert_allclose(logits, ref[:, :10], atol=1e-4, rtol=0)
  for t in range(10, 24):
    logits, cache, _ = forward(params, cfg, toks[:, t:t + 1], cache, method, "decode")
    np.testing.assert_allclose(logits[:, 0], ref[:, t], atol=1e-4, rtol=0)
  # two rows per call go through the same code too
  cache = init_cache(method, cfg, 1, 64, jnp.float32)
  _, cache, _ = forward(params, cfg, toks[:, :10], cache, method, "prefill")
  logits, cache, _ = forward(params, cfg, toks[:, 10:12], cache, method, "decode")
  np.testing.assert_allclose(logits, ref[:, 10:12], atol=1e-4, rtol=0)
  assert int(cache.lengths[0]) == 12


def test_logits_do_not_depend_on_future_tokens():
  model = tiny_model(seed=2)
  toks = np.asarray(random_prompts(3, [16], model.config.vocab_size))
  changed = toks.copy()
  changed[0, 10:] = (changed[0, 10:] + 1) % model.config.vocab_size
  a = sj.forward(model, toks)
  b = sj.forward(model, changed)
  np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
  assert not np.allclose(a[:, 10:], b[:, 10:])


def test_batched_ragged_generation_equals_alone():
  model = tiny_model(seed=3)
  prompts = random_prompts(4, [5, 17, 11], model.config.vocab_size)
  batched = sj.generate(model, prompts, max_new_tokens=12, stop_tokens=())
  for i, p in enumerate(prompts):
    alone = sj.generate(model, [p], max_new_tokens=12, stop_tokens=())
    np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])


def test_greedy_generation_matches_argmax_of_forward():
  model = tiny_model(seed=4)
  prompt = random_prompts(5, [9], model.config.vocab_size)[0]
  out = sj.generate(model, [prompt], max_new_tokens=8, stop_tokens=())
  seq = list(prompt)
  for _ in range(8):
    logits = sj.forward(model, np.asarray([seq]))
    seq.append(int(jnp.argmax(logits[0, -1])))
  assert out.tokens[0].tolist() == seq[len(prompt):]


def test_stop_tokens_end_a_row_and_pad_it():
  model = tiny_model(seed=4)
  prompt = random_prompts(5, [9], model.config.vocab_size)[0]
  free = sj.generate(model, [prompt], max_new_tokens=8, stop_tokens=()).tokens[0].tolist()
  stop = free[2]
  out = sj.generate(model, [prompt], max_new_tokens=8, stop_tokens=(stop,))
  first = free.index(stop)
  assert out.tokens[0].tolist()[:first + 1] == free[:first + 1]
  assert int(out.num_tokens[0]) == first + 1
  assert all(t == stop for t in out.tokens[0].tolist()[first + 1:])


def test_sampling_is_reproducible_and_top_p_tiny_is_greedy():
  model = tiny_model(seed=6)
  prompt = random_prompts(7, [6], model.config.vocab_size)
  a = sj.generate(model, prompt, max_new_tokens=6, temperature=1.0, seed=3, stop_tokens=())
  b = sj.generate(model, prompt, max_new_tokens=6, temperature=1.0, seed=3, stop_tokens=())
  np.testing.assert_array_equal(a.tokens, b.tokens)
  greedy = sj.generate(model, prompt, max_new_tokens=6, stop_tokens=())
  nucleus = sj.generate(model, prompt, max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=3, stop_tokens=())
  np.testing.assert_array_equal(greedy.tokens, nucleus.tokens)


def test_bfloat16_runs_close_to_float32():
  m32 = tiny_model(seed=8)
  m16 = tiny_model(seed=8, dtype=jnp.bfloat16)
  toks = np.asarray(random_prompts(9, [12], m32.config.vocab_size))
  a = sj.forward(m32, toks)
  b = sj.forward(m16, toks)
  assert b.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(a - b))) < 0.1 * float(jnp.max(jnp.abs(a)))


@pytest.mark.parametrize("bad, match", [
    (dict(tokens=[[]]), "empty prompt"),
    (dict(tokens=[[1, 2, 500]]), "outside the vocabulary"),
    (dict(tokens=[[1, 2]], max_new_tokens=4000), "exceeds the model's context"),
    (dict(tokens=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    (dict(tokens=[[1, 2]], cache="fulll"), "did you mean 'full'"),
])
def test_bad_generate_input_fails_clearly(bad, match):
  model = tiny_model(seed=0)
  with pytest.raises(ValueError, match=match):
    sj.generate(model, **bad)


@pytest.mark.parametrize("chunk", [16, 37, 5])
def test_prefill_in_row_chunks_equals_one_piece(chunk, monkeypatch):
  """A long prompt's per-row work runs in pieces of ROW_CHUNK rows of B·T (`decoder.in_row_chunks`): with
  pieces that split rows of the batch unevenly (and a remainder) the logits and the stored cache are those of
  one piece."""
  model = tiny_model(seed=4)
  cfg, params = model.config, model.params
  toks, lens = sj.pad_prompts(random_prompts(5, [30, 19], cfg.vocab_size))
  method = cache_config("full")

  def prefill():
    cache = init_cache(method, cfg, 2, 64, jnp.float32)
    logits, cache, _ = decoder.forward(params, cfg, jnp.asarray(toks), cache, method, "prefill",
                                       prompt_lengths=jnp.asarray(lens))
    return logits, cache

  whole_logits, whole_cache = prefill()
  monkeypatch.setattr(decoder, "ROW_CHUNK", chunk)
  logits, cache = prefill()
  np.testing.assert_allclose(logits, whole_logits, atol=3e-5, rtol=1e-5)   # GEMMs of other shapes round apart
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(whole_cache)):
    np.testing.assert_allclose(a, b, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("name,settings", [("full", {}), ("kivi", dict(bits=2, group_size=8, residual=8)),
                                           ("specache", dict(bits=1, group_size=8, residual=8, topk=8))],
                         ids=["full", "kivi", "specache"])
def test_prefill_over_per_layer_states_equals_the_stacked_scan(name, settings):
  """generate_jit prefills a prompt of one row chunk through the per-layer loop (per-layer weights and states);
  `prefill_cache`, longer prompts and the tests' stacked caches through the layer scan: the same logits and the
  same cache, leaf by leaf."""
  model = tiny_model(seed=4, n_layers=3)
  cfg, params = model.config, model.params
  method = cache_config(name, **settings)
  toks, lens = sj.pad_prompts(random_prompts(5, [40, 27], cfg.vocab_size))
  toks, lens = jnp.asarray(toks), jnp.asarray(lens)
  run = jax.jit(lambda p, c: decode.prefill(p, cfg, method, toks, lens, c))
  logits_s, stacked = run(params, init_cache(method, cfg, 2, 96, jnp.float32))
  logits_l, per_layer = run(decoder.unstack_params(params, cfg.n_layers),
                            decoder.per_layer(init_cache(method, cfg, 2, 96, jnp.float32), cfg.n_layers))
  assert decoder.is_per_layer(per_layer.layers) and not decoder.is_per_layer(stacked.layers)
  np.testing.assert_allclose(logits_l, logits_s, rtol=1e-6, atol=1e-6)
  for layer, (st_l, st_s) in enumerate(zip(per_layer.layers, decoder.per_layer(stacked, cfg.n_layers).layers)):
    for a, b in zip(jax.tree.leaves(st_l), jax.tree.leaves(st_s)):
      np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1e-6,
                                 err_msg=f"layer {layer}")
  np.testing.assert_array_equal(per_layer.lengths, stacked.lengths)


