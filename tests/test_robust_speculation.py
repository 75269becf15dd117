"""SpeCache's speculation options (caches/speculation.py: skip_ring, candidates, exact_on_miss, lowbit_in_output,
correct_with_fetched, lookup, lookup_rows, anchor_match, exact_ring): exact with k >= n, offloaded = simulated,
what each selects, what the candidate rows see, how the next guesses are chosen, what enters the output, the
presets and the removed options (lookup's own tests: tests/test_history.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import decode
from specache_jax.caches import attention as A
from specache_jax.caches import lowbit
from specache_jax.caches import selection
from specache_jax.caches import specache as sc
from specache_jax.caches import speculation
from specache_jax.caches.hit_stats import query_drift
from specache_jax.decode import init_cache
from specache_jax.model.decoder import forward_jit as forward
from tests.tiny import random_prompts, tiny_model

BASE = dict(bits=1, group_size=8, residual=8)
OPTIONS = {
    "skip_ring": dict(skip_ring=True),
    "candidates": dict(candidates=2),
    "candidates3": dict(candidates=3),
    "all": dict(skip_ring=True, exact_on_miss=True, candidates=2),
    "lowbit_out": dict(lowbit_in_output=False),
    "lowbit_out_eom_cand": dict(lowbit_in_output=False, exact_on_miss=True, candidates=2),
    "eom_with_fetched": dict(exact_on_miss=True, correct_with_fetched=True),
    "nonspec_with_fetched": dict(speculative=False, correct_with_fetched=True),
    "kivi_rule_robust": dict(one_bit="kivi", candidates=3, exact_on_miss=True, correct_with_fetched=True,
                             lowbit_in_output=False),
    "lookup": dict(lookup=1),
    "anchor_match": dict(lookup=4, lookup_rows=3, anchor_match=2),
    "lookup_rows": dict(lookup=2, lookup_rows=3),
    "lookup_rows_robust": dict(lookup=2, lookup_rows=2, candidates=2, exact_on_miss=True, correct_with_fetched=True,
                               lowbit_in_output=False),
    "exact_ring": dict(exact_ring=True),
    "exact_ring_robust": dict(exact_ring=True, skip_ring=True, lookup=2, lookup_rows=2, candidates=2,
                              exact_on_miss=True, correct_with_fetched=True, lowbit_in_output=False),
}
# Offloaded = simulated (the slowest check): the combinations that hold every option at least once (CI time)
OFFLOADED = ("all", "candidates3", "lowbit_out_eom_cand", "eom_with_fetched", "nonspec_with_fetched",
             "kivi_rule_robust", "lookup", "anchor_match", "lookup_rows_robust", "exact_ring_robust")


def _model():
  return tiny_model(seed=21, head_dim=16)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_topk_covering_the_context_equals_the_full_cache(name):
  model = _model()
  prompts = random_prompts(5, [20, 31], model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=12, stop_tokens=())
  got = sj.generate(model, prompts, max_new_tokens=12, stop_tokens=(),
                    cache=sj.cache_config("specache", topk=64, **BASE, **OPTIONS[name]))
  np.testing.assert_array_equal(got.tokens, full.tokens)


def test_the_offloaded_combinations_hold_every_option():
  assert set().union(*(OPTIONS[n] for n in OFFLOADED)) == set().union(*OPTIONS.values())


@pytest.mark.parametrize("name", OFFLOADED)
def test_offloaded_gives_the_simulated_tokens(name):
  model = _model()
  prompts = random_prompts(11, [30, 44, 17], model.config.vocab_size)
  kw = dict(BASE, topk=4, **OPTIONS[name])
  sim = sj.generate(model, prompts, max_new_tokens=14, stop_tokens=(), cache=sj.cache_config("specache", **kw))
  off = sj.generate(model, prompts, max_new_tokens=14, stop_tokens=(),
                    cache=sj.cache_config("specache", offload=True, **kw))
  np.testing.assert_array_equal(off.tokens, sim.tokens)


def test_candidates_and_an_output_without_low_bit_values_change_what_is_attended_with_a_small_k():
  """(skip_ring has its own test below: it changes κ only across a ring flush.)"""
  model = _model()
  prompts = random_prompts(12, [40, 33], model.config.vocab_size)
  faithful = sj.generate(model, prompts, max_new_tokens=16, stop_tokens=(),
                         cache=sj.cache_config("specache", topk=3, **BASE))
  for name in ("candidates", "all", "lowbit_out"):
    got = sj.generate(model, prompts, max_new_tokens=16, stop_tokens=(),
                      cache=sj.cache_config("specache", topk=3, **BASE, **OPTIONS[name]))
    assert not np.array_equal(got.tokens, faithful.tokens), name


def _after_predecode(method, n_prompt=37, seed=3):
  model = _model()
  cfg, params = model.config, model.params
  toks = jnp.asarray(random_prompts(seed, [n_prompt + 1], cfg.vocab_size))
  cache = init_cache(method, cfg, 1, 64, jnp.float32)
  _, cache, _ = forward(params, cfg, toks[:, :n_prompt], cache, method, "prefill")
  _, cache, _ = forward(params, cfg, toks[:, n_prompt:n_prompt + 1], cache, method, "predecode")
  return model, toks, cache


def _layer0_step_inputs(method, seed: int, n_keys: int):
  """After pre-decoding: (cache, layer 0's state, random (q, k, v) of a 2-row decoding step, the n_keys keys
  split from `seed`, of which the first three made q, k, v)."""
  model, _, cache = _after_predecode(method)
  cfg = model.config
  keys = jax.random.split(jax.random.key(seed), n_keys)
  q = jax.random.normal(keys[0], (1, 2, cfg.n_heads, cfg.head_dim))
  k, v = (jax.random.normal(kk, (1, 2, cfg.n_kv_heads, cfg.head_dim)) for kk in keys[1:3])
  return cache, jax.tree.map(lambda a: a[0], cache.layers), (q, k, v), keys


@pytest.mark.parametrize("lowbit_in_output", [True, False])
def test_without_lowbit_in_output_the_low_bit_values_never_reach_the_output_and_keys_still_choose_kappa(
    lowbit_in_output):
  """Scrambling the low-bit values (codes, scales, zeros) changes a decoding step's output only when the output
  attends the low-bit rows (the ring's values are 16-bit); scrambling the low-bit keys changes κ_{t+1} either
  way (it is chosen from the low-bit scores)."""
  method = sj.cache_config("specache", topk=5, lowbit_in_output=lowbit_in_output, **BASE)
  cache, st, (q, k, v), keys = _layer0_step_inputs(method, seed=5, n_keys=9)
  codes = lambda key, a: jax.random.randint(key, a.shape, 0, 256).astype(a.dtype)
  low = st.low
  values = low.replace(v_codes=codes(keys[3], low.v_codes), v_scale=jax.random.uniform(keys[4], low.v_scale.shape),
                       v_zero=jax.random.normal(keys[5], low.v_zero.shape))
  keys_ = low.replace(k_codes=codes(keys[6], low.k_codes), k_scale=jax.random.uniform(keys[7], low.k_scale.shape),
                      k_zero=jax.random.normal(keys[8], low.k_zero.shape))
  out, st1, _ = sc.attend(method, st, q, k, v, cache.lengths)
  out_v, _, _ = sc.attend(method, st.replace(low=values), q, k, v, cache.lengths)
  if lowbit_in_output:
    assert float(jnp.max(jnp.abs(out - out_v))) > 1e-3
  else:
    np.testing.assert_allclose(np.asarray(out_v), np.asarray(out), rtol=1e-6, atol=1e-6)
  _, st1_k, _ = sc.attend(method, st.replace(low=keys_), q, k, v, cache.lengths)
  assert not np.array_equal(np.asarray(st1.kappa), np.asarray(st1_k.kappa))


@pytest.mark.parametrize("exact_ring", [False, True])
def test_exact_ring_reads_the_rings_16_bit_keys_where_kivis_rule_reads_its_last_windows_low_bit_ones(exact_ring):
  """37 stored tokens, R = g = 8: the ring holds positions 29..36, of which 29..31 are in the last quantized key
  window. With the low-bit copy out of the output, scrambling the low-bit keys (codes, scales, zeros) changes the
  step's output only by KIVI's rule (those three ring columns' keys); with exact_ring the output reads the ring's
  16-bit keys and is unchanged, and κ_{t+1} (chosen from the low-bit scores) is neither in the ring nor ≥ n."""
  method = sj.cache_config("specache", topk=5, lowbit_in_output=False, skip_ring=True, exact_ring=exact_ring,
                           **BASE)
  cache, st, (q, k, v), keys = _layer0_step_inputs(method, seed=7, n_keys=6)
  codes = lambda key, a: jax.random.randint(key, a.shape, 0, 256).astype(a.dtype)
  low = st.low
  scrambled = low.replace(k_codes=codes(keys[3], low.k_codes), k_scale=jax.random.uniform(keys[4], low.k_scale.shape),
                          k_zero=jax.random.normal(keys[5], low.k_zero.shape))
  out, st1, _ = sc.attend(method, st, q, k, v, cache.lengths)
  out_s, _, _ = sc.attend(method, st.replace(low=scrambled), q, k, v, cache.lengths)
  if exact_ring:
    np.testing.assert_allclose(np.asarray(out_s), np.asarray(out), rtol=1e-6, atol=1e-6)
  else:
    assert float(jnp.max(jnp.abs(out - out_s))) > 1e-3
  n = int(cache.lengths[0])
  ring_from = n + 1 - BASE["residual"] if exact_ring else (n + 1) // BASE["residual"] * BASE["residual"]
  assert int(jnp.max(st1.kappa)) < ring_from


@pytest.mark.parametrize("with_fetched", [False, True])
def test_correct_with_fetched_scores_the_rows_on_the_device_from_their_16_bit_keys(with_fetched):
  """A synchronous κ_t choice (here: exact_on_miss after a miss) with correct_with_fetched reads the prefetched
  rows' scores from their 16-bit keys: scrambling those positions' low-bit key codes leaves the choice as it
  is; without it the choice reads those codes."""
  method = sj.cache_config("specache", topk=5, exact_on_miss=True, correct_with_fetched=with_fetched, **BASE)
  cache, st, (q, k, v), keys = _layer0_step_inputs(method, seed=8, n_keys=4)
  st = st.replace(miss=jnp.ones((1,), bool))                                  # a miss
  rows = np.zeros(st.low.k_codes.shape[:3], bool)                           # [B, K, S]: the prefetched positions
  for h in range(rows.shape[1]):
    rows[0, h, np.asarray(st.kappa[0, h])] = True
  scrambled = jnp.where(jnp.asarray(rows)[..., None],
                        jax.random.randint(keys[3], st.low.k_codes.shape, 0, 256).astype(st.low.k_codes.dtype),
                        st.low.k_codes)
  choose = lambda s: np.asarray(sc.kappa_for_step(method, s, q, k, v, cache.lengths))
  same = np.array_equal(choose(st), choose(st.replace(low=st.low.replace(k_codes=scrambled))))
  assert same == with_fetched


def test_skip_ring_picks_only_positions_the_next_attend_reads_from_kappa():
  method = sj.cache_config("specache", topk=5, skip_ring=True, **BASE)
  model, toks, cache = _after_predecode(method)
  key_qlen = int(lowbit.boundaries(jnp.asarray([37]), 8)[0][0])              # 32: the ring holds 32..36
  assert int(np.asarray(cache.layers.kappa).max()) < key_qlen
  for step in range(6):                                                     # across a ring flush (n = 40)
    n = int(cache.lengths[0])
    _, cache, _ = forward(model.params, model.config, jnp.asarray([[3 + step, 4]]), cache, method, "decode")
    next_qlen = int(lowbit.boundaries(jnp.asarray([n + 1]), 8)[0][0])
    assert int(np.asarray(cache.layers.kappa).max()) < next_qlen, (step, n)
  faithful = sj.cache_config("specache", topk=5, **BASE)
  _, _, plain = _after_predecode(faithful)
  assert int(np.asarray(plain.layers.kappa).max()) >= key_qlen             # without it, ring slots are picked


def test_default_state_carries_no_speculative_query():
  cfg = _model().config
  faithful = sj.cache_config("specache", topk=3, **BASE)
  st = jax.eval_shape(lambda: faithful.impl.init(faithful, cfg, 2, 64, jnp.float32))
  assert st.spec_q.shape[-1] == 0
  tracking = sj.cache_config("specache", topk=3, track_hits=True, **BASE)     # its drift statistic
  st = jax.eval_shape(lambda: tracking.impl.init(tracking, cfg, 2, 64, jnp.float32))
  assert st.spec_q.shape[1:] == (2, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)


@pytest.mark.parametrize("settings, match", [
    (dict(candidates=0), "candidates=0"), (dict(lookup=-1), "lookup=-1"), (dict(anchor_match=0), "anchor_match=0"),
    (dict(candidates=2, speculative=False), "candidates=2 are speculative rows; they need speculative=True"),
    (dict(lookup=2, speculative=False), "lookup=2 adds a speculative guess; it needs speculative=True"),
    (dict(lowbit_in_output="no"), "lowbit_in_output='no' must be a bool"),
    (dict(exact_ring=1), "exact_ring=1 must be a bool"),
    (dict(correct_with_fetched=1, exact_on_miss=True), "correct_with_fetched=1 must be a bool"),
    (dict(correct_with_fetched=True), "needs exact_on_miss=True or speculative=False"),
    (dict(lookup_rows=2), "needs lookup > 0"), (dict(lookup=2, lookup_rows=9, topk=8), "lookup_rows=9 must be at most"),
    (dict(speculation="robust"), "speculation='robust' must be a SpeCacheSpeculation"),
    (dict(one_bit="mean"), "one_bit='mean' was removed"),
    (dict(hedge=16), "hedge=16: the option 'hedge' .* was removed"),
    (dict(hedge=16, hedge_shift=1), "; hedge_shift=1: the option 'hedge_shift' .* was removed"),
    (dict(drift=0.1), "drift=0.1: the option 'drift' .* was removed"),
    (dict(candidate_merge="mean"), "candidate_merge='mean': the option 'candidate_merge' .* was removed"),
    (dict(score_levels="range"), "score_levels='range': the option 'score_levels' .* was removed"),
    (dict(preset="robust", drift=0.1), "'drift' .* was removed")])
def test_bad_robust_speculation_settings(settings, match):
  with pytest.raises(ValueError, match=match):
    sj.cache_config("specache", **settings)


def test_presets_name_settings_that_explicit_ones_override():
  robust = sj.cache_config("specache", bits=1, preset="robust")
  spec = robust.speculation
  assert (spec.candidates, spec.exact_on_miss, spec.correct_with_fetched, spec.lowbit_in_output) == (
      3, True, True, False)
  assert (spec.lookup, robust.topk, spec.lookup_rows) == (3, 128, 64)      # its own k, half of it for anchors
  assert spec.exact_ring and spec.skip_ring                                 # the ring in 16-bit, κ outside it
  assert robust.bits == 1 and spec == speculation.robust(128) and hash(robust) == hash(
      sj.cache_config("specache", bits=1, topk=128, speculation=speculation.robust(128)))
  k32 = sj.cache_config("specache", bits=1, topk=32, preset="robust")
  assert (k32.topk, k32.speculation.lookup_rows) == (32, 16)               # a k given: still half
  assert sj.cache_config("specache", bits=1, topk=32, lookup_rows=32, preset="robust").speculation.lookup_rows == 32
  two = sj.cache_config("specache", preset="robust", candidates=2, lowbit_in_output=True).speculation
  assert (two.candidates, two.lowbit_in_output, two.lookup) == (2, True, 3)   # flat settings on the preset's value
  assert sj.cache_config("specache", bits=1, exact_on_miss=True) == sj.cache_config(
      "specache", bits=1, speculation=speculation.EXACT_ON_MISS)
  assert sj.cache_config("specache", speculative=False).speculation == speculation.NON_SPECULATIVE
  assert sj.cache_config("specache", speculation=speculation.EXACT_ON_MISS, candidates=2).speculation == (
      speculation.SpeCacheSpeculation(exact_on_miss=True, candidates=2))
  assert sj.cache_config("specache", bits=1, preset="faithful") == sj.cache_config("specache", bits=1)
  with pytest.raises(sj.ConfigError, match=r"preset='fast' is not a SpeCache preset.*faithful.*robust"):
    sj.cache_config("specache", preset="fast")
  with pytest.raises(sj.ConfigError, match="'full' has no presets"):
    sj.cache_config("full", preset="robust")


def test_a_preset_label_goes_stale_when_the_preset_is_redefined(monkeypatch):
  """Stored cells of a preset label carry its resolved settings in their fingerprint: a redefined preset
  recomputes them instead of reusing the old preset's results."""
  import ml_collections
  from experiments.lib import methods
  config = ml_collections.ConfigDict(dict(methods=dict(r=dict(name="specache", bits=1, preset="robust"),
                                                       f=dict(name="specache", bits=1))))
  before = methods.settings_fingerprint_parts(config, "r")
  assert before["preset_settings"]["bits"] == 1 and "preset_settings" not in methods.settings_fingerprint_parts(
      config, "f")
  monkeypatch.setitem(sc.PRESETS, "robust", lambda settings: dict(candidates=2))
  after = methods.settings_fingerprint_parts(config, "r")
  assert after["preset_settings"]["candidates"] == 2 and after != before


def test_robust_preset_with_topk_covering_the_context_equals_the_full_cache():
  model = _model()
  prompts = random_prompts(6, [20, 31], model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=12, stop_tokens=())
  got = sj.generate(model, prompts, max_new_tokens=12, stop_tokens=(),
                    cache=sj.cache_config("specache", topk=64, preset="robust", **BASE))
  np.testing.assert_array_equal(got.tokens, full.tokens)


def test_candidate_rows_sit_at_the_next_position_and_see_only_the_real_row():
  """One step of [T, g1, g2] with two candidates: the real row's logits are the faithful step's, and candidate c's
  are exactly those of a faithful step [T, g_c] (same position, same κ_t, blind to the other candidate)."""
  two = sj.cache_config("specache", topk=3, candidates=2, **BASE)
  one = sj.cache_config("specache", topk=3, **BASE)
  model, toks, cache2 = _after_predecode(two)
  _, _, cache1 = _after_predecode(one)
  assert two.speculation.width == 3 and two.speculation.row_offsets(3) == (0, 1, 1)
  np.testing.assert_array_equal(np.asarray(cache2.layers.kappa), np.asarray(cache1.layers.kappa))
  step = jnp.asarray([[int(toks[0, 37]), 5, 9]], jnp.int32)
  got, after, _ = forward(model.params, model.config, step, cache2, two, "decode")
  for c in (1, 2):
    want, _, _ = forward(model.params, model.config, step[:, (0, c)], cache1, one, "decode")
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want[:, 0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[:, c]), np.asarray(want[:, 1]), rtol=1e-5, atol=1e-5)
  assert int(after.lengths[0]) == 38                                        # only the real row is stored
  mask = np.asarray(A.new_rows_mask(1, (0, 1, 1)))[0, 0]
  np.testing.assert_array_equal(mask, [[1, 0, 0], [1, 1, 0], [1, 0, 1]])


def test_candidates_merge_their_probabilities_into_one_top_k():
  rng = np.random.default_rng(1)
  probs = jnp.asarray(rng.random((2, 3, 4, 40)), jnp.float32)              # rows: real, 3 candidates
  n = jnp.asarray([39, 20])
  scores = selection.Scores(probs[:, :, 1:], jnp.zeros((2, 3, 3, 0)), jnp.zeros((2, 3, 0), jnp.int32))  # no 16-bit
  method = sj.cache_config("specache", topk=5, candidates=3, **BASE)
  kappa = np.asarray(sc._next_kappa(method, None, scores, n))       # no lookup_rows: no state read
  for b in range(2):
    score = np.where(np.arange(40) < int(n[b]) + 1, np.max(np.asarray(probs[b, :, 1:]), axis=1), -1.0)
    for k in range(3):
      assert set(kappa[b, k].tolist()) == set(np.argsort(-score[k], kind="stable")[:5].tolist())


def test_next_guesses_come_from_the_candidate_that_was_right():
  method = sj.cache_config("specache", candidates=2, **BASE)
  logits = np.zeros((3, 3, 10), np.float32)                        # [B, W, V]; row 0's logits play no part
  logits[:, 1, [1, 3]] = [2.0, 1.0]                                # candidate row 1: token 1, then 3
  logits[:, 2, [2, 4]] = [2.0, 1.0]                                # candidate row 2: token 2, then 4
  logits = jnp.asarray(logits)
  inp = jnp.asarray([[7, 8, 9], [7, 8, 9], [7, 8, 9]], jnp.int32)
  nxt = jnp.asarray([9, 8, 5], jnp.int32)                          # candidate 2 right, candidate 1 right, none
  got = np.asarray(decode.next_input(method, inp, nxt, logits))
  np.testing.assert_array_equal(got, [[9, 2, 4], [8, 1, 3], [5, 1, 3]])
  hits, steps, missed = decode.speculation(method, inp, nxt, jnp.asarray([True, True, True]))
  assert (float(hits), float(steps)) == (2.0, 3.0) and np.asarray(missed).tolist() == [False, False, True]


def test_query_drift_with_candidates_measures_the_nearest_candidate():
  two = sj.cache_config("specache", topk=3, candidates=2, track_hits=True, **BASE)
  cfg = _model().config
  st = jax.eval_shape(lambda: two.impl.init(two, cfg, 1, 64, jnp.float32))
  g = cfg.n_heads // cfg.n_kv_heads
  assert st.spec_q.shape == (cfg.n_layers, 1, cfg.n_kv_heads, 2 * g, cfg.head_dim)
  rng = np.random.default_rng(2)
  real = jnp.asarray(rng.standard_normal((1, 1, cfg.n_heads, cfg.head_dim)), jnp.float32)
  far = jnp.asarray(rng.standard_normal((1, 1, cfg.n_heads, cfg.head_dim)), jnp.float32)
  for order in ((far, real), (real, far)):                   # the real query is one of the candidates: drift 0
    q = jnp.concatenate([real, *order], axis=1)
    st0 = sc._with_spec_query(two, _blank_state(two, cfg), q)
    np.testing.assert_allclose(np.asarray(query_drift(st0, q)), 0.0, atol=1e-6)


def _blank_state(method, cfg):
  return jax.tree.map(lambda a: a[0], method.impl.init(method, cfg, 1, 64, jnp.float32))


# Greedy tokens of the default (faithful) SpeCache 1-bit on this tiny model, recorded at e100108 — before the decode
# protocol learned several speculative rows (candidates): the default configuration's tokens must not change.
FAITHFUL_TOKENS = [[55, 51, 2, 29, 74, 10, 95, 95, 2, 73, 86, 59], [49, 7, 71, 21, 39, 54, 70, 40, 35, 50, 9, 9],
                   [7, 20, 82, 24, 55, 50, 40, 48, 33, 60, 37, 7]]
EOM_TOKENS = [[55, 51, 2, 31, 35, 9, 55, 75, 9, 55, 10, 77], [49, 7, 71, 19, 9, 54, 46, 37, 54, 54, 17, 84],
              [7, 20, 7, 31, 38, 77, 40, 94, 9, 5, 92, 31]]


@pytest.mark.parametrize("settings, want", [(dict(), FAITHFUL_TOKENS), (dict(offload=True), FAITHFUL_TOKENS),
                                            (dict(exact_on_miss=True), EOM_TOKENS)])
def test_default_configuration_tokens_are_unchanged(settings, want):
  model = _model()
  prompts = random_prompts(5, [20, 31, 26], model.config.vocab_size)
  out = sj.generate(model, prompts, max_new_tokens=12, stop_tokens=(),
                    cache=sj.cache_config("specache", topk=3, **BASE, **settings))
  np.testing.assert_array_equal(np.asarray(out.tokens), want)
