"""Numerical guards: `check_numerics=True` names the step and layer where NaN/Inf first appear; bf16 outliers of
±1e4 in the keys and values still give finite logits and caches through KIVI and SpeCache."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import decode, guards
from specache_jax.model.decoder import forward_jit
from tests.tiny import random_prompts, tiny_model

LENGTHS = [21, 14]
KIVI = dict(bits=2, group_size=8, residual=16)
SPEC = dict(bits=1, group_size=8, residual=8, topk=4)


@functools.lru_cache(maxsize=None)
def _model(dtype=jnp.float32):
  return tiny_model(seed=23, dtype=dtype, head_dim=16, n_heads=4, n_kv_heads=2, ffn_dim=32, n_layers=3)


def _with(params, path, fn):
  """A copy of params with params[path...] replaced by fn(old)."""
  out = jax.tree.map(lambda x: x, params)
  node = out
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = fn(node[path[-1]])
  return out


def _poisoned_layer(layer: int, value: float):
  """wk of one layer poisoned: that layer's keys, hence its cache entries, turn non-finite at the prefill."""
  model = _model()
  params = _with(model.params, ("layers", "wk"), lambda w: w.at[layer, 0, :].set(value))
  return dataclass_replace(model, params)


def dataclass_replace(model, params):
  return type(model)(model.config, params)


@pytest.mark.parametrize("method,layer,value", [
    ("full", 1, np.inf), ("kivi", 2, np.nan), ("specache_offloaded", 1, -np.inf),
])
def test_poisoned_layer_is_named(method, layer, value):
  cache = {"full": sj.cache_config("full"), "kivi": sj.cache_config("kivi", **KIVI),
           "specache_offloaded": sj.cache_config("specache", offload=True, **SPEC)}[method]
  model = _poisoned_layer(layer, value)
  prompts = random_prompts(3, LENGTHS, model.config.vocab_size)
  with pytest.raises(guards.NonFiniteError, match=rf"step 0 \(prefill\) in the cache entries of layer {layer} "):
    sj.generate(model, prompts, max_new_tokens=6, cache=cache, stop_tokens=(), check_numerics=True)


def test_first_bad_step_and_the_logits_are_named():
  """A token whose embedding row is NaN is only read once generated: the guard names that decoding step."""
  model = _model()
  prompts = random_prompts(4, LENGTHS, model.config.vocab_size)
  run = lambda m: sj.generate(m, prompts, max_new_tokens=8, stop_tokens=(), check_numerics=True)
  clean = np.asarray(run(model).tokens)            # finite: no error
  seen = set(np.concatenate(prompts).tolist()) | {0}    # 0 pads the prompts: its row is read at prefill
  step, tok = next((j, int(clean[0, j])) for j in range(1, 7)
                   if int(clean[0, j]) not in seen | set(clean[:, :j].ravel().tolist()))
  bad = dataclass_replace(model, _with(model.params, ("embed",), lambda e: e.at[tok].set(jnp.nan)))
  # token `step` is fed back at decoding step step+1; its row writes layer 0's cache first
  with pytest.raises(guards.NonFiniteError, match=rf"at step {step + 1} \(decode\) in the cache entries of layer 0 "):
    run(bad)
  head = dataclass_replace(model, _with(model.params, ("lm_head",), lambda w: w.at[0, 5].set(jnp.inf)))
  with pytest.raises(guards.NonFiniteError, match=r"at step 0 \(prefill\) in the logits"):
    run(head)


@pytest.mark.parametrize("settings", [SPEC, dict(SPEC, exact_on_miss=True), dict(SPEC, speculative=False)],
                         ids=["speculative", "exact_on_miss", "non_speculative"])
def test_offloaded_generation_with_check_numerics_runs_to_the_end(settings):
  """The runtime's guard is composition, not a class made at run time: every phase of the offloaded runtime
  (incl. exact_on_miss's synchronous fetches) runs under check_numerics, with the unchecked run's tokens."""
  model = _model()
  prompts = random_prompts(6, LENGTHS, model.config.vocab_size)
  cache = sj.cache_config("specache", offload=True, **settings)
  plain = sj.generate(model, prompts, max_new_tokens=8, cache=cache, stop_tokens=())
  checked = sj.generate(model, prompts, max_new_tokens=8, cache=cache, stop_tokens=(), check_numerics=True)
  np.testing.assert_array_equal(np.asarray(checked.tokens), np.asarray(plain.tokens))
  assert np.asarray(checked.num_tokens).tolist() == [8, 8]


def test_offloaded_guard_names_the_decoding_step_as_the_jitted_loop_does():
  """A NaN embedding row read only once generated: the offloaded runtime and the jitted loop name the same step."""
  model = _model()
  prompts = random_prompts(4, LENGTHS, model.config.vocab_size)
  caches = {"jit": sj.cache_config("specache", **SPEC), "offload": sj.cache_config("specache", offload=True, **SPEC)}
  run = lambda m, c: sj.generate(m, prompts, max_new_tokens=8, stop_tokens=(), check_numerics=True, cache=c)
  clean = np.asarray(run(model, caches["offload"]).tokens)
  seen = set(np.concatenate(prompts).tolist()) | {0}
  step, tok = next((j, int(clean[0, j])) for j in range(1, 7)
                   if int(clean[0, j]) not in seen | set(clean[:, :j].ravel().tolist()))
  bad = dataclass_replace(model, _with(model.params, ("embed",), lambda e: e.at[tok].set(jnp.nan)))
  messages = []
  for cache in caches.values():
    with pytest.raises(guards.NonFiniteError, match=r"\(decode\)") as err:
      run(bad, cache)
    messages.append(str(err.value))
  assert messages[0] == messages[1]
  first_bad = int(messages[0].split("at step ")[1].split()[0])
  assert 1 <= first_bad <= step + 1          # fed as the real token at step+1 (as a guess possibly earlier)


def test_record_keeps_the_first_bad_step_and_lowest_layer():
  layers = {"k": jnp.zeros((4, 2, 3)), "codes": jnp.zeros((4, 2), jnp.uint8)}
  rec = guards.update(guards.empty_record(), 0, "prefill", jnp.zeros((2, 5)), layers)
  assert guards.describe(rec, 4) is None
  bad = {"k": layers["k"].at[2, 1, 0].set(jnp.nan).at[3, 0, 0].set(jnp.inf), "codes": layers["codes"]}
  rec = guards.update(rec, 5, "decode", jnp.zeros((2, 5)), bad)
  rec = guards.update(rec, 6, "decode", jnp.full((2, 5), jnp.nan), {"k": layers["k"].at[0].set(jnp.nan)})
  assert np.asarray(rec).tolist() == [5, guards.PHASES.index("decode"), 2]
  assert "step 5 (decode) in the cache entries of layer 2 (of 4" in guards.describe(rec, 4)


def _outlier_model():
  """bf16 weights whose keys and values carry ±1e4 outliers in two channels of every layer."""
  model = _model(jnp.bfloat16)
  cfg = model.config
  rs = np.random.RandomState(0)
  big = lambda: jnp.asarray(2e4 * rs.randn(cfg.n_layers, cfg.dim) / np.sqrt(cfg.dim), jnp.bfloat16)
  params = _with(model.params, ("layers", "wk"), lambda w: w.at[:, :, 3].set(big()))
  params = _with(params, ("layers", "wv"), lambda w: w.at[:, :, cfg.head_dim + 5].set(big()))
  return dataclass_replace(model, params)


def test_outlier_model_really_has_large_keys_and_values():
  model = _outlier_model()
  cfg = model.config
  toks, lens = sj.pad_prompts(random_prompts(5, LENGTHS, cfg.vocab_size))
  cache = decode.init_cache(sj.cache_config("full"), cfg, 2, 32, jnp.bfloat16)
  _, cache, _ = forward_jit(model.params, cfg, jnp.asarray(toks), cache, sj.cache_config("full"), "prefill",
                            prompt_lengths=jnp.asarray(lens))
  k = np.abs(np.asarray(cache.layers.k, np.float32))
  v = np.abs(np.asarray(cache.layers.v, np.float32))
  assert k.max() > 5e3 and v.max() > 5e3 and np.isfinite(k).all() and np.isfinite(v).all()


@pytest.mark.parametrize("name,settings", [("kivi", KIVI), ("specache", SPEC)])
def test_bf16_outliers_stay_finite_through_low_bit_caches(name, settings):
  model = _outlier_model()
  prompts = random_prompts(5, LENGTHS, model.config.vocab_size)
  out = sj.generate(model, prompts, max_new_tokens=8, stop_tokens=(), check_numerics=True,
                    cache=sj.cache_config(name, **settings))
  assert np.asarray(out.num_tokens).tolist() == [8, 8]
