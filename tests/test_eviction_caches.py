"""StreamingLLM and H2O: equal to `full` when nothing is evicted; kept positions follow each rule exactly
(checked against a float64 numpy simulation); ragged batches equal rows alone; budgets match device bytes."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax.caches import attention as A
from specache_jax.caches import h2o, streaming
from specache_jax.caches.budget import device_bytes_at, matched_budget
from specache_jax.decode import init_cache
from specache_jax.errors import ConfigError
from specache_jax.model import decoder
from specache_jax.model.decoder import forward_jit as forward
from tests.tiny import random_prompts, tiny_model

B, K, G, H = 3, 2, 2, 8          # layer-level tests: batch, KV heads, group, head dim
N = K * G


# ---------------------------------------------------------------- float64 reference of one attention row

def _ref_row(q_NH, k_TKH, v_TKH, kept_per_kv):
  """One new row at the last position of each kept list: out [N, H] and, per KV head, {pos: prob mean over G}."""
  out = np.zeros((N, H))
  probs = []
  for kh in range(K):
    cols = np.asarray(kept_per_kv[kh])
    mean = np.zeros(len(cols))
    for n in range(kh * G, (kh + 1) * G):
      logits = k_TKH[cols, kh] @ q_NH[n] / np.sqrt(H)
      p = np.exp(logits - logits.max())
      p /= p.sum()
      out[n] = p @ v_TKH[cols, kh]
      mean += p / G
    probs.append(dict(zip(cols.tolist(), mean.tolist())))
  return out, probs


def _random_layer_inputs(seed, lengths, steps):
  rs = np.random.RandomState(seed)
  total = int(max(lengths)) + steps
  return (rs.randn(B, total, N, H), rs.randn(B, total, K, H), rs.randn(B, total, K, H))


def _layer_state(mod, cfg):
  shapes = types.SimpleNamespace(n_layers=1, n_kv_heads=K, head_dim=H)
  return jax.tree.map(lambda x: x[0], mod.init(cfg, shapes, B, 64, jnp.float32))


def _new_rows(x_all, p_B):
  return jnp.asarray(x_all[np.arange(B), p_B][:, None], jnp.float32)       # [B, 1, ...]


def _held(pos_row):
  return sorted(int(x) for x in pos_row if x >= 0)


# ---------------------------------------------------------------- StreamingLLM rule

@pytest.mark.parametrize("budget, sink", [(8, 2), (5, 0)], ids=lambda x: str(x))
def test_streaming_keeps_sinks_and_window(budget, sink):
  cfg = streaming.StreamingConfig(budget=budget, sink=sink)
  lengths, steps = np.asarray([3, 10, 17]), 9
  q_all, k_all, v_all = _random_layer_inputs(budget, lengths, steps)
  tp = int(lengths.max())
  st = streaming.prefill(cfg, _layer_state(streaming, cfg), jnp.asarray(k_all[:, :tp], jnp.float32),
                         jnp.asarray(v_all[:, :tp], jnp.float32), jnp.asarray(lengths))
  attend = jax.jit(streaming.attend, static_argnums=0)

  def expected(n):      # positions kept after n tokens
    return sorted(set(range(min(sink, n))) | set(range(max(sink, n - (budget - sink)), n)))

  for i in range(steps + 1):
    n = lengths + i
    pos = np.asarray(st.pos)
    for b in range(B):
      assert _held(pos[b]) == expected(int(n[b])), (b, i)
      slots = np.flatnonzero(pos[b] >= 0)
      np.testing.assert_allclose(np.asarray(st.k)[b][:, slots], np.swapaxes(k_all[b, pos[b, slots]], 0, 1),
                                 atol=1e-6)
    if i == steps:
      break
    out, st, aux = attend(cfg, st, _new_rows(q_all, n), _new_rows(k_all, n), _new_rows(v_all, n),
                          jnp.asarray(n))
    assert aux == {}
    for b in range(B):
      kept = expected(int(n[b])) + [int(n[b])]
      ref, _ = _ref_row(q_all[b, n[b]], k_all[b], v_all[b], [kept] * K)
      np.testing.assert_allclose(np.asarray(out[b, 0]), ref, atol=1e-5)


# ---------------------------------------------------------------- H2O rule

def _ref_colsum(q_all, k_all, lengths, tp):
  """Attention each prompt key receives, summed over valid query rows, averaged over the group: [B, K, Tp]."""
  col = np.zeros((B, K, tp))
  for b in range(B):
    for r in range(int(lengths[b])):
      _, probs = _ref_row(q_all[b, r], k_all[b], k_all[b], [list(range(r + 1))] * K)
      for kh in range(K):
        for p, w in probs[kh].items():
          col[b, kh, p] += w
  return col


def _ref_h2o_prefill(colsum, length, budget, recent):
  older = np.arange(max(0, length - recent))
  heavy = older[np.argsort(-colsum[older], kind="stable")][:budget - recent]
  return {int(p): float(colsum[p]) for p in list(heavy) + list(range(max(0, length - recent), length))}


@pytest.mark.parametrize("budget, recent", [(8, 3), (6, None), (6, 6)], ids=lambda x: str(x))
def test_h2o_keeps_recent_and_heavy_hitters_by_accumulated_attention(budget, recent):
  cfg = h2o.H2OConfig(budget=budget, recent=recent)
  r = cfg.recent_tokens
  lengths, steps = np.asarray([4, 11, 16]), 10
  q_all, k_all, v_all = _random_layer_inputs(100 + budget, lengths, steps)
  tp = int(lengths.max())
  qp, kp, vp = (jnp.asarray(x[:, :tp], jnp.float32) for x in (q_all, k_all, v_all))
  _, colsum = A.prefill_attention(qp, kp, vp, jnp.asarray(lengths), H ** -0.5, want_colsum=True)
  ref_col = _ref_colsum(q_all, k_all, lengths, tp)
  np.testing.assert_allclose(np.asarray(colsum), ref_col, atol=1e-5)     # what the decoder hands to prefill
  st = h2o.prefill(cfg, _layer_state(h2o, cfg), kp, vp, jnp.asarray(lengths), colsum)
  ref = [[_ref_h2o_prefill(ref_col[b, kh], int(lengths[b]), budget, r) for kh in range(K)] for b in range(B)]
  attend = jax.jit(h2o.attend, static_argnums=0)
  for i in range(steps + 1):
    n = lengths + i
    pos, score = np.asarray(st.pos), np.asarray(st.score)
    for b in range(B):
      for kh in range(K):
        assert _held(pos[b, kh]) == sorted(ref[b][kh]), (b, kh, i)
        slots = np.flatnonzero(pos[b, kh] >= 0)
        np.testing.assert_allclose(score[b, kh, slots], [ref[b][kh][p] for p in pos[b, kh, slots]], atol=1e-5)
        np.testing.assert_allclose(np.asarray(st.v)[b, kh, slots], v_all[b, pos[b, kh, slots], kh], atol=1e-6)
    if i == steps:
      break
    out, st, _ = attend(cfg, st, _new_rows(q_all, n), _new_rows(k_all, n), _new_rows(v_all, n), jnp.asarray(n))
    for b in range(B):
      p_new = int(n[b])
      got, probs = _ref_row(q_all[b, p_new], k_all[b], v_all[b], [sorted(ref[b][kh]) + [p_new] for kh in range(K)])
      np.testing.assert_allclose(np.asarray(out[b, 0]), got, atol=1e-5)
      for kh in range(K):
        kept = ref[b][kh]
        for p in kept:
          kept[p] += probs[kh][p]
        if len(kept) == budget:
          victim = min((p for p in kept if p <= p_new - r), key=kept.get)
          del kept[victim]
        kept[p_new] = probs[kh][p_new]
  # heavy hitters outlive the window (unless recent == budget: a plain sliding window)
  older = [min(ref[b][kh]) < int(lengths[b]) + steps - budget for b in range(B) for kh in range(K)]
  assert any(older) == (r < budget)


def test_h2o_prefill_through_the_decoder_keeps_the_top_colsum_positions():
  model = tiny_model(seed=21, head_dim=16)
  cfg, params = model.config, model.params
  toks = jnp.asarray(random_prompts(21, [19], cfg.vocab_size))
  method = sj.cache_config("h2o", budget=8, recent=3)
  _, cache, _ = forward(params, cfg, toks, init_cache(method, cfg, 1, 32, jnp.float32), method, "prefill")
  lp0 = jax.tree.map(lambda x: x[0], params["layers"])
  lengths = jnp.asarray([19])
  rope = decoder.rope_for(cfg, "prefill", lengths, toks.shape[1])
  q, k, v = decoder.attention_inputs(cfg, lp0, decoder.embed(params, toks), rope)
  _, colsum = A.prefill_attention(q, k, v, lengths, cfg.head_dim ** -0.5, want_colsum=True)
  for kh in range(cfg.n_kv_heads):
    want = _ref_h2o_prefill(np.asarray(colsum[0, kh]), 19, 8, 3)
    assert _held(np.asarray(cache.layers.pos[0, 0, kh])) == sorted(want)
  assert not np.array_equal(cache.layers.pos[0, 0, 0], cache.layers.pos[0, 0, 1])   # per KV head choices


# ---------------------------------------------------------------- through the model

def _decode_logits(model, method, prompt, steps):
  cfg, params = model.config, model.params
  toks = jnp.asarray([prompt])
  cache = init_cache(method, cfg, 1, 64, jnp.float32)
  _, cache, _ = forward(params, cfg, toks[:, :len(prompt) - steps], cache, method, "prefill")
  out = []
  for t in range(len(prompt) - steps, len(prompt)):
    logits, cache, _ = forward(params, cfg, toks[:, t:t + 1], cache, method, "decode")
    out.append(logits[0, 0])
  return jnp.stack(out), cache


@pytest.mark.parametrize("name, settings", [("streaming", dict(budget=32, sink=4)),
                                             ("h2o", dict(budget=32, recent=8))], ids=["streaming", "h2o"])
def test_budget_covering_the_context_equals_full_at_every_decode_step(name, settings):
  model = tiny_model(seed=22, head_dim=16)
  prompt = random_prompts(22, [24], model.config.vocab_size)[0]
  ref = sj.forward(model, np.asarray([prompt]))[0, -12:]
  got, cache = _decode_logits(model, sj.cache_config(name, **settings), prompt, 12)
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
  assert int(cache.lengths[0]) == 24 and int(jnp.max(cache.layers.pos)) == 23


PROMPT_LENGTHS = [17, 30, 25]          # all pad to width 32 alone: one compiled program per batch size


@pytest.mark.parametrize("name, settings", [("streaming", dict(sink=2)), ("h2o", dict(recent=6))],
                         ids=["streaming", "h2o"])
def test_generation_equals_full_when_nothing_is_evicted_and_ragged_batch_equals_alone(name, settings):
  model = tiny_model(seed=23, head_dim=16)
  prompts = random_prompts(23, PROMPT_LENGTHS, model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=20, stop_tokens=())
  roomy = sj.generate(model, prompts, max_new_tokens=20, stop_tokens=(),
                      cache=sj.cache_config(name, budget=64, **settings))
  np.testing.assert_array_equal(roomy.tokens, full.tokens)
  # budget 24: row 0 fits at prefill and starts evicting while decoding, rows 1 and 2 evict from the prompt
  method = sj.cache_config(name, budget=24, **settings)
  batched = sj.generate(model, prompts, max_new_tokens=20, cache=method, stop_tokens=())
  assert not np.array_equal(batched.tokens, full.tokens)
  for i, p in enumerate(prompts):
    alone = sj.generate(model, [p], max_new_tokens=20, cache=method, stop_tokens=())
    np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])


# ---------------------------------------------------------------- configs and budgets

@pytest.mark.parametrize("name, settings, match", [
    ("streaming", dict(budget=0), "budget=0 must be an integer >= 1"),
    ("streaming", dict(sink=-1), "sink=-1 must be an integer >= 0"),
    ("streaming", dict(budget=4, sink=4), "budget=4 must be larger than sink=4"),
    ("streaming", dict(budget=3, sink=4), "budget=3 must be larger than sink=4"),
    ("h2o", dict(budget=0), "budget=0 must be an integer >= 1"),
    ("h2o", dict(budget=8, recent=0), "recent=0 must be an integer >= 1"),
    ("h2o", dict(budget=8, recent=9), "recent=9 must be <= budget=8"),
    ("h2o", dict(budget=8.0), "budget=8.0 must be an integer")])
def test_bad_configs_fail_clearly(name, settings, match):
  with pytest.raises(ConfigError, match=match):
    sj.cache_config(name, **settings)


def test_h2o_default_recent_is_half_the_budget():
  assert (h2o.H2OConfig(budget=10).recent_tokens, h2o.H2OConfig(budget=10).heavy) == (5, 5)
  assert h2o.H2OConfig(budget=1).recent_tokens == 1


def test_device_bytes_from_shapes_equal_the_real_arrays():
  cfg = tiny_model(seed=0, head_dim=16).config
  for method in (sj.cache_config("streaming", budget=20), sj.cache_config("h2o", budget=20),
                 sj.cache_config("full"), sj.cache_config("specache", bits=1, group_size=16, residual=16, topk=8)):
    real = method.impl.device_bytes(method, method.impl.init(method, cfg, 2, 64, jnp.bfloat16))
    assert device_bytes_at(method, cfg, 64, jnp.bfloat16, batch=2) == real, method.name


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_matched_budget_fits_under_the_reference_within_one_slot(name):
  cfg = tiny_model(seed=0, head_dim=16).config
  ref = sj.cache_config("specache", bits=1, group_size=16, residual=16, topk=8)
  for max_len in (256, 1024):
    target = device_bytes_at(ref, cfg, max_len, jnp.bfloat16)
    method = matched_budget(name, ref, cfg, max_len, jnp.bfloat16)
    assert method.name == name
    one_more = sj.cache_config(name, budget=method.budget + 1)
    assert device_bytes_at(method, cfg, max_len, jnp.bfloat16) <= target
    assert device_bytes_at(one_more, cfg, max_len, jnp.bfloat16) > target
  # the budget follows the reference's growth with the context; other settings pass through
  small = matched_budget(name, ref, cfg, 256, jnp.bfloat16, **({"sink": 2} if name == "streaming" else {"recent": 4}))
  assert small.budget < method.budget and small.budget > 4
  with pytest.raises(ConfigError, match="less than"):
    matched_budget(name, sj.cache_config("full"), cfg, 1, jnp.bfloat16)
  with pytest.raises(ConfigError, match="method_name='kivi'"):
    matched_budget("kivi", ref, cfg, 256, jnp.bfloat16)
