"""SpeCache's `predecode=False` ablation: no pre-decoding pass, so step 1 attends no κ_1 and its speculative row is
a placeholder (T1 repeated); simulated and offloaded agree; the option's validation and fingerprint."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from experiments.lib import methods
from specache_jax import decode
from specache_jax.caches.speculation import NO_PREDECODE, SpeCacheSpeculation
from specache_jax.errors import ConfigError
from specache_jax.model.decoder import forward_jit as forward
from tests.tiny import random_prompts, tiny_model

KW = dict(group_size=8, residual=8)


def _model():
  return tiny_model(seed=21, head_dim=16)


def _step_1(model, method, prompt):
  """Prefill, `decode.start`, decoding step 1 -> (start's input [1, W], the cache after start, step 1's logits
  [1, W, V], the cache after step 1)."""
  cfg, params = model.config, model.params
  toks = jnp.asarray([prompt])
  cache = decode.init_cache(method, cfg, 1, method.slots(len(prompt) + 4), jnp.float32)
  logits, cache, _ = forward(params, cfg, toks, cache, method, "prefill")
  first = decode.guess(logits[:, -1])
  inp, started, _ = decode.start(params, cfg, method, first, cache)
  logits, after, _ = forward(params, cfg, inp, started, method, "decode")
  return inp, started, logits, after


def test_step_1_without_predecode_attends_no_kappa_and_guesses_t1_again():
  model = _model()
  prompt = random_prompts(3, [37], model.config.vocab_size)[0]
  method = sj.cache_config("specache", bits=1, topk=4, predecode=False, **KW)
  inp, started, logits, after = _step_1(model, method, prompt)
  assert int(inp[0, 0]) == int(inp[0, 1])                                 # the placeholder: T1 repeated
  assert np.all(np.asarray(started.layers.kappa) == -1)                    # nothing fetched for step 1
  # with no κ_1, step 1's real row is the k = 0 cache's (which pre-decodes but fetches nothing) ...
  k0 = sj.cache_config("specache", bits=1, topk=0, **KW)
  _, _, logits0, after0 = _step_1(model, k0, prompt)
  np.testing.assert_allclose(logits[:, 0], logits0[:, 0], atol=1e-6)
  for name in ("low", "k16", "v16"):                                        # ... and stores the same row
    jax.tree.map(np.testing.assert_array_equal, getattr(after.layers, name), getattr(after0.layers, name))
  # ... where the default's κ_1 changes it; κ_2 is the placeholder row's top-k (stored positions 0..n)
  _, _, logits_pd, _ = _step_1(model, sj.cache_config("specache", bits=1, topk=4, **KW), prompt)
  assert not np.allclose(logits[:, 0], logits_pd[:, 0], atol=1e-4)
  kappa = np.asarray(after.layers.kappa)
  assert kappa.min() >= 0 and kappa.max() <= len(prompt)


def test_topk_covering_the_context_gives_the_full_cache_tokens_except_through_step_1():
  """With every position fetchable, the default gives the full cache's tokens. Without pre-decoding, step 1
  reads the low-bit copy (T2 is the k = 0 cache's) and T1's stored K/V past layer 0 come from that step: the
  tokens after it may differ — unless the prompt lies in the 16-bit ring, where nothing is low-bit at step 1."""
  model = _model()
  long = random_prompts(5, [20, 31, 45], model.config.vocab_size)
  full = sj.generate(model, long, max_new_tokens=8, stop_tokens=())
  kw = dict(bits=1, topk=64, **KW)
  default = sj.generate(model, long, max_new_tokens=8, stop_tokens=(), cache=sj.cache_config("specache", **kw))
  nopd = sj.generate(model, long, max_new_tokens=8, stop_tokens=(),
                     cache=sj.cache_config("specache", predecode=False, **kw))
  k0 = sj.generate(model, long, max_new_tokens=8, stop_tokens=(),
                   cache=sj.cache_config("specache", **dict(kw, topk=0)))
  np.testing.assert_array_equal(default.tokens, full.tokens)
  np.testing.assert_array_equal(nopd.tokens[:, :2], k0.tokens[:, :2])
  assert not np.array_equal(nopd.tokens, full.tokens)           # on this model step 1's low bits change tokens
  short = random_prompts(6, [5, 7], model.config.vocab_size)    # within R = 8: step 1 reads 16-bit only
  np.testing.assert_array_equal(
      sj.generate(model, short, max_new_tokens=8, stop_tokens=(),
                  cache=sj.cache_config("specache", predecode=False, **kw)).tokens,
      sj.generate(model, short, max_new_tokens=8, stop_tokens=()).tokens)


@pytest.mark.parametrize("store,extra", [("numpy", {}), ("pinned_host", dict(exact_on_miss=True))],
                         ids=["numpy", "pinned_host-exact_on_miss"])
def test_offloaded_tokens_equal_simulated_without_predecode(store, extra):
  model = tiny_model(seed=31, head_dim=16)
  prompts = random_prompts(7, [12, 37, 25], model.config.vocab_size)
  kw = dict(bits=1, topk=4, predecode=False, **KW, **extra)
  sim = sj.generate(model, prompts, max_new_tokens=24, cache=sj.cache_config("specache", **kw), stop_tokens=())
  off = sj.generate(model, prompts, max_new_tokens=24, stop_tokens=(),
                    cache=sj.cache_config("specache", offload=True, host_store=store, **kw))
  np.testing.assert_array_equal(off.tokens, sim.tokens)


def test_predecode_is_a_validated_flat_key():
  method = sj.cache_config("specache", bits=1, predecode=False)
  assert method.speculation == NO_PREDECODE and not method.speculation.predecodes
  assert method.speculation.width == 2 and method.flat_settings()["predecode"] is False
  assert sj.cache_config("specache", bits=1).speculation.predecodes
  with pytest.raises(ConfigError, match=r"predecode='no' must be a bool"):
    sj.cache_config("specache", predecode="no")
  with pytest.raises(ConfigError, match=r"predecode=0 must be a bool"):
    SpeCacheSpeculation(predecode=0)
  # the non-speculative ablation has no pre-decoding pass to turn off: refused, not silently the same config
  with pytest.raises(ConfigError, match="predecode=False .* speculative=False has none"):
    sj.cache_config("specache", speculative=False, predecode=False)
  assert not sj.cache_config("specache", speculative=False).speculation.predecodes


def test_a_preset_label_fingerprint_names_predecode_only_when_it_is_off():
  """Cells stored before the option existed keep their fingerprint (pre-decoding on is what they ran)."""
  config = type("C", (), {})()
  config.methods = {"robust": dict(name="specache", bits=1, preset="robust"),
                    "robust_nopd": dict(name="specache", bits=1, preset="robust", predecode=False)}
  config.extra_methods = ""
  on = methods.settings_fingerprint_parts(config, "robust")
  off = methods.settings_fingerprint_parts(config, "robust_nopd")
  assert "predecode" not in on["preset_settings"] and off["preset_settings"]["predecode"] is False
