"""Prompt lookup (history.py) and SpeCache's `lookup` / `lookup_rows`: the matches against a loop reference on
fresh random ids, the ids a cache records against the tokens it was given, the guesses and anchors the decode
protocol derives from them, κ taking the anchor windows first, and named errors. (k >= n = full cache and
offloaded = simulated for both options: tests/test_robust_speculation.py's OPTIONS.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib.bench import states
import specache_jax as sj
from specache_jax import decode, history
from specache_jax.caches import selection
from specache_jax.caches import specache as sc
from specache_jax.errors import ConfigError
from specache_jax.model import decoder as dec
from tests.tiny import random_prompts, tiny_model

BASE = dict(bits=1, group_size=8, residual=8)


def _match_reference(seq, ngram, min_match=1):
  """End of the latest earlier occurrence of the longest suffix (<= ngram) of seq that occurs earlier, or -1
  (also where that suffix is shorter than min_match)."""
  n = len(seq)
  for g in range(min(ngram, n - 1), 0, -1):
    for i in range(n - 2, g - 2, -1):
      if seq[i - g + 1:i + 1] == seq[n - g:]:
        return i if g >= min_match else -1
  return -1


def _random_ids(rs, batch, slots, vocab, tail):
  ids = rs.randint(0, vocab, (batch, slots)).astype(np.int32)
  lengths = rs.randint(0, slots - tail + 1, batch).astype(np.int32)
  return ids, lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookup_and_anchors_match_a_loop_reference(seed):
  rs = np.random.RandomState(seed)
  for _ in range(40):
    vocab, ngram, min_match = rs.randint(1, 5), rs.randint(1, 4), rs.randint(1, 3)
    ids, lengths = _random_ids(rs, 3, rs.randint(3, 14), vocab, tail=2)
    inp = rs.randint(0, vocab, (3, 3)).astype(np.int32)
    got_lookup = np.asarray(history.lookup(jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(inp[:, 0]), ngram))
    got_anchors = np.asarray(history.anchors(jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(inp), ngram,
                                             min_match))
    for b in range(3):
      seq = ids[b, :lengths[b]].tolist() + [int(inp[b, 0])]
      at = _match_reference(seq, ngram)
      assert got_lookup[b] == (seq[at + 1] if at >= 0 else history.NONE), (ids[b], lengths[b], inp[b], ngram)
      want = [_match_reference(seq, ngram, min_match)] + [
          _match_reference(seq + [int(inp[b, c])], ngram, min_match) for c in (1, 2)]
      assert got_anchors[b].tolist() == [w + 1 if w >= 0 else history.NONE for w in want]


def test_lookup_finds_a_copied_phrase_and_a_cycle_and_prefers_the_longer_match():
  ids = jnp.asarray([[5, 6, 7, 8, 1, 6, 9, 0, 0, 0]], jnp.int32)
  # "... 1 6" -> the latest 6 is followed by 9; with "5 6" (2-gram) the earlier phrase wins: 7
  assert int(history.lookup(ids, jnp.asarray([7]), jnp.asarray([6]), 1)[0]) == 9
  ids2 = ids.at[0, 6].set(5)                                               # ... 1 6 5 | next 6: "5 6" -> 7
  assert int(history.lookup(ids2, jnp.asarray([7]), jnp.asarray([6]), 2)[0]) == 7
  cycle = jnp.asarray([[3, 4, 3, 4, 3, 0]], jnp.int32)                      # next 4 after "3 4 3": 3
  assert int(history.lookup(cycle, jnp.asarray([5]), jnp.asarray([4]), 3)[0]) == 3
  assert int(history.lookup(cycle, jnp.asarray([5]), jnp.asarray([7]), 3)[0]) == history.NONE


def test_write_rows_drops_positions_past_the_end():
  ids = history.empty(2, 4)
  got = history.write_rows(ids, jnp.asarray([[1, 2], [3, 4]]), jnp.asarray([1, 3]))
  np.testing.assert_array_equal(np.asarray(got), [[0, 1, 2, 0], [0, 0, 0, 3]])


def test_guesses_take_the_looked_up_token_in_the_last_slot_only_when_it_is_new():
  method = sj.cache_config("specache", candidates=3, lookup=2, **BASE)
  logits = jnp.asarray([[0.0, 5.0, 4.0, 3.0, 1.0]] * 3)                     # top 3: 1, 2, 3
  got = decode.guesses(method, logits, jnp.asarray([4, 2, history.NONE], jnp.int32))
  np.testing.assert_array_equal(np.asarray(got), [[1, 2, 4], [1, 2, 3], [1, 2, 3]])


def _run(method, model, prompts, new_tokens):
  """Prefill + start + decode steps by hand -> (cache, generated tokens [B, new_tokens])."""
  cfg, params = model.config, model.params
  toks = jnp.asarray(prompts, jnp.int32)
  b, t = toks.shape
  cache = decode.init_cache(method, cfg, b, decode.slots_for(t + new_tokens, method.speculation.width), jnp.float32)
  logits, cache = decode.prefill(params, cfg, method, toks, jnp.full((b,), t, jnp.int32), cache)
  first = decode.guess(logits)
  inp, cache, _ = decode.start(params, cfg, method, first, cache)
  out = [first]
  for _ in range(new_tokens - 1):
    logits, cache, _ = dec.forward(params, cfg, inp, cache, method, "decode")
    nxt = decode.guess(logits[:, 0])
    _, _, missed = decode.speculation(method, inp, nxt, jnp.ones(nxt.shape, bool))
    inp = decode.next_input(method, inp, nxt, logits, cache.tokens, cache.lengths)
    cache = decode.observe_speculation(method, cache, missed, inp)
    out.append(nxt)
  return cache, inp, jnp.stack(out, axis=1)


def test_the_cache_records_the_prompt_and_every_real_token_and_the_guess_is_the_lookup():
  model = tiny_model(seed=4, head_dim=16)
  method = sj.cache_config("specache", topk=4, candidates=2, lookup=2, **BASE)
  prompts = random_prompts(8, [23, 23], model.config.vocab_size)
  cache, inp, out = _run(method, model, prompts, 9)
  n = 23 + 8                                                   # the last sampled token is not stored yet
  np.testing.assert_array_equal(np.asarray(cache.lengths), [n, n])
  want = np.concatenate([np.asarray(prompts), np.asarray(out[:, :-1])], axis=1)
  np.testing.assert_array_equal(np.asarray(cache.tokens[:, :n]), want)
  np.testing.assert_array_equal(np.asarray(inp[:, 0]), np.asarray(out[:, -1]))
  looked_up = np.asarray(history.lookup(cache.tokens, cache.lengths, out[:, -1], 2))
  for b in range(2):
    if looked_up[b] != history.NONE:
      assert looked_up[b] in np.asarray(inp[b, 1:])


def test_every_anchor_window_is_in_kappa_and_lookup_rows_equal_to_topk_fetches_only_windows():
  """A step whose input continues a phrase of the prompt: κ_{t+1} holds the candidate's whole window (it
  outranks any probability) in every layer and KV head; with lookup_rows = topk, κ is that window."""
  model = tiny_model(seed=4, head_dim=16)
  cfg, params = model.config, model.params
  prompt = jnp.asarray([list(range(10, 40)) + list(range(10, 20))], jnp.int32)     # ... 18 19 | next: 20 21
  for rows in (3, 6):
    method = sj.cache_config("specache", topk=6, lookup=3, lookup_rows=rows, **BASE)
    cache = decode.init_cache(method, cfg, 1, 64, jnp.float32)
    _, cache = decode.prefill(params, cfg, method, prompt, jnp.asarray([40]), cache)
    _, cache, _ = decode.start(params, cfg, method, jnp.asarray([20]), cache)
    inp = jnp.asarray([[20, 21]], jnp.int32)
    cache = decode.observe_speculation(method, cache, jnp.zeros((1,), bool), inp)
    anchors = np.asarray(cache.layers.anchor[0, 0])                       # layer 0, row 0
    np.testing.assert_array_equal(anchors, [11, 12])        # "18 19 20" ends at 10, "19 20 21" at 11: + 1
    _, cache, _ = dec.forward(params, cfg, inp, cache, method, "decode")   # κ_{t+1} from the candidate's anchor
    window = set(range(12 - rows // 2, 12 - rows // 2 + rows))             # the rows nearest to 12
    for layer in range(cfg.n_layers):
      for head in np.asarray(cache.layers.kappa[layer, 0]):
        assert window <= set(head.tolist()), (window, head)
        if rows == method.topk:
          assert set(head.tolist()) == window


def test_anchored_scores_rank_the_windows_first_and_ignore_missing_anchors():
  rs = np.random.RandomState(0)
  low = jnp.asarray(rs.uniform(size=(1, 2, 1, 20)), jnp.float32)
  scores = selection.Scores(low=low, extra=jnp.zeros((1, 2, 1, 0)), extra_pos=jnp.zeros((1, 2, 0), jnp.int32))
  boosted = lambda sc: set(np.flatnonzero(np.asarray(sc.dense()[0, 0, 0]) >= selection.ANCHOR_BOOST))
  everything = jnp.asarray([20])                                           # no 16-bit keys on the device
  got = selection.anchored(scores, jnp.asarray([[5, history.NONE]], jnp.int32), 3, everything, window=4)
  assert boosted(got) == {4, 5, 6}                                         # window 3..6: the 3 nearest to 5
  top = np.asarray(jax.lax.top_k(got.dense()[:, :, 0], 3)[1])
  assert all(set(row) == {4, 5, 6} for row in top[0])                     # before any scored position
  edge = selection.anchored(scores, jnp.asarray([[0, 19]], jnp.int32), 3, everything, window=4)   # clipped
  assert boosted(edge) == {0, 19, 1}                                       # shared, nearest first, then anchor 0
  two = jnp.asarray([[5, 12]], jnp.int32)
  assert boosted(selection.anchored(scores, two, 4, everything, window=4)) == {4, 5, 6, 12}
  assert boosted(selection.anchored(scores, two, 8, everything, window=4)) == {3, 4, 5, 6, 10, 11, 12, 13}
  # keys from 10 on are 16-bit on the device: the budget goes to the other window
  assert boosted(selection.anchored(scores, two, 4, jnp.asarray([10]), window=4)) == {3, 4, 5, 6}
  assert boosted(selection.anchored(scores, two, 4, jnp.asarray([3]), window=4)) == set()


def test_lookup_options_name_their_errors():
  with pytest.raises(ConfigError, match="lookup=2 adds a speculative guess"):
    sj.cache_config("specache", lookup=2, speculative=False, **BASE)
  with pytest.raises(ConfigError, match="lookup_rows=4 anchors"):
    sj.cache_config("specache", lookup_rows=4, **BASE)
  with pytest.raises(ConfigError, match="lookup_rows=9 must be at most topk=8"):
    sj.cache_config("specache", topk=8, lookup=1, lookup_rows=9, **BASE)
  with pytest.raises(ConfigError, match="lookup"):
    sj.cache_config("specache", lookup=-1, **BASE)
  with pytest.raises(ConfigError, match="anchor_match"):
    sj.cache_config("specache", lookup=3, lookup_rows=4, anchor_match=0, **BASE)
  method = sj.cache_config("specache", topk=4, lookup=2, **BASE)
  with pytest.raises(ValueError, match="needs the cache's token ids"):
    decode.lookup_guess(method, None, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))
  model = tiny_model(seed=4, head_dim=16)
  cap = states.Captured(k=jnp.zeros((2, 1, 16, 2, 16)), v=jnp.zeros((2, 1, 16, 2, 16)),
                        colsum=jnp.zeros((2, 1, 2, 16)))
  with pytest.raises(ConfigError, match="needs the prompts' tokens_BT"):
    states.build_cache(cap, jnp.asarray([16]), cfg=model.config, method=method, max_len=32)


def test_a_lookup_method_records_the_prompt_when_built_from_a_capture():
  model = tiny_model(seed=4, head_dim=16)
  method = sj.cache_config("specache", topk=4, lookup=2, **BASE)
  prompt = jnp.asarray(random_prompts(3, [16], model.config.vocab_size), jnp.int32)
  _, cap = states.capture(model.params, model.config, prompt, jnp.asarray([16]))
  cache = states.build_cache(cap, jnp.asarray([16]), prompt, cfg=model.config, method=method, max_len=32)
  np.testing.assert_array_equal(np.asarray(cache.tokens[:, :16]), np.asarray(prompt))
