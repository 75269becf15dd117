"""Retrieval baselines (Quest, InfLLM): the pages / blocks chosen and the attention over them follow the rule (checked against a
float64 numpy simulation); equal to `full` when the budget covers the context; ragged batches equal rows alone;
bytes split between device and host; budgets match SpeCache 1-bit's device bytes; bad settings refused."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from experiments.lib import methods
from specache_jax.caches import attention as A
from specache_jax.caches import infllm, quest
from specache_jax.caches.budget import device_bytes_at, matched_budget
from specache_jax.decode import init_cache
from specache_jax.errors import ConfigError
from specache_jax.model.decoder import forward_jit as forward
from tests.tiny import random_prompts, tiny_model

B, K, G, H = 3, 2, 2, 8          # layer-level tests: batch, KV heads, group, head dim
N = K * G


def _layer_state(mod, cfg, max_len=64):
  shapes = types.SimpleNamespace(n_layers=1, n_kv_heads=K, head_dim=H)
  return jax.tree.map(lambda x: x[0], mod.init(cfg, shapes, B, max_len, jnp.float32))


def _new_rows(x_all, p_B):
  return jnp.asarray(x_all[np.arange(B), p_B][:, None], jnp.float32)       # [B, 1, ...]


def _ref_quest_step(q_NH, k_TKH, v_TKH, n, page_size, n_pages):
  """float64: the pages a step at position n chooses per KV head and its output [N, H]."""
  cur = n // page_size
  out, chosen = np.zeros((N, H)), []
  for kh in range(K):
    bounds = []
    for pg in range(cur):
      rows = k_TKH[pg * page_size:(pg + 1) * page_size, kh]
      lo, hi = rows.min(0), rows.max(0)
      bounds.append(max(np.maximum(q_NH[n_] * lo, q_NH[n_] * hi).sum() for n_ in range(kh * G, (kh + 1) * G)))
    best = sorted(np.argsort(-np.asarray(bounds), kind="stable")[:n_pages - 1].tolist()) if cur else []
    pages = best + [cur]
    chosen.append(pages)
    cols = [p for pg in pages for p in range(pg * page_size, (pg + 1) * page_size) if p < n] + [n]
    for n_ in range(kh * G, (kh + 1) * G):
      logits = k_TKH[cols, kh] @ q_NH[n_] / np.sqrt(H)
      p = np.exp(logits - logits.max())
      out[n_] = (p / p.sum()) @ v_TKH[cols, kh]
  return out, chosen


@pytest.mark.parametrize("budget, page_size", [(12, 4), (8, 2)], ids=lambda x: str(x))
def test_quest_attends_the_current_page_and_the_best_bounded_pages(budget, page_size):
  cfg = quest.QuestConfig(budget=budget, page_size=page_size)
  lengths, steps = np.asarray([5, 18, 29]), 9
  rs = np.random.RandomState(budget)
  total = int(lengths.max()) + steps
  q_all, k_all, v_all = rs.randn(B, total, N, H), rs.randn(B, total, K, H), rs.randn(B, total, K, H)
  tp = int(lengths.max())
  st = quest.prefill(cfg, _layer_state(quest, cfg), jnp.asarray(k_all[:, :tp], jnp.float32),
                     jnp.asarray(v_all[:, :tp], jnp.float32), jnp.asarray(lengths))
  attend = jax.jit(quest.attend, static_argnums=0)
  n_pages = budget // page_size
  for i in range(steps):
    n = lengths + i
    out, st, aux = attend(cfg, st, _new_rows(q_all, n), _new_rows(k_all, n), _new_rows(v_all, n), jnp.asarray(n))
    assert aux == {}
    for b in range(B):
      ref, chosen = _ref_quest_step(q_all[b, n[b]], k_all[b], v_all[b], int(n[b]), page_size, n_pages)
      np.testing.assert_allclose(np.asarray(out[b, 0]), ref, atol=1e-5)
      for kh in range(K):
        got = sorted(int(p) for p in np.asarray(st.pages)[b, kh] if p <= int(n[b]) // page_size)
        assert got == chosen[kh], (b, kh, i)
      # the page bounds are those of every stored key, the new one included
      held = int(n[b]) + 1
      for pg in range(-(-held // page_size)):
        rows = k_all[b, pg * page_size:min((pg + 1) * page_size, held)]
        np.testing.assert_allclose(np.asarray(st.kmin)[b, :, pg], rows.min(0), atol=0)
        np.testing.assert_allclose(np.asarray(st.kmax)[b, :, pg], rows.max(0), atol=0)


def test_page_score_bounds_every_key_of_the_page():
  rs = np.random.RandomState(3)
  k = jnp.asarray(rs.randn(B, K, 32, H), jnp.float32)
  q = jnp.asarray(rs.randn(B, 1, N, H), jnp.float32)
  lo, hi = quest.page_bounds(k, jnp.full((B,), 32), 8)
  score = np.asarray(quest.page_scores(q, lo, hi))                         # [B, K, 4]
  exact = np.einsum("bkgh,bksh->bkgs", np.asarray(q[:, 0]).reshape(B, K, G, H), np.asarray(k))
  per_page = exact.reshape(B, K, G, 4, 8).max(axis=(2, 4))
  assert np.all(score >= per_page - 1e-5) and np.any(score > per_page + 1e-3)


class _RefInfLLM:
  """float64 InfLLM for one row and KV head: representative scores per position, representatives per formed block."""

  def __init__(self, cfg, k_TH, v_TH, colsum_T, length):
    self.cfg, self.k, self.v = cfg, k_TH, v_TH
    self.score = np.zeros(len(k_TH))
    self.score[:length] = colsum_T[:length]
    self.reps = {}
    for j in range(self.formed(length)):
      self.form(j)

  def formed(self, n):
    c = self.cfg
    return max(0, (n - c.n_init - c.window + c.block_size) // c.block_size)

  def form(self, j):
    c = self.cfg
    rows = np.arange(c.n_init + j * c.block_size, c.n_init + (j + 1) * c.block_size)
    top = rows[np.argsort(-self.score[rows], kind="stable")[:c.repr_topk]]
    self.reps[j] = self.k[top].mean(0)

  def step(self, q_GH, n, x):
    """The new row at position n: (out [G, H], blocks chosen); then its scores, storage and block formation."""
    c = self.cfg
    cands = list(range(self.formed(n)))
    bound = [max(q_GH[g] @ self.reps[j] for g in range(G)) for j in cands]
    chosen = sorted(np.asarray(cands)[np.argsort(-np.asarray(bound), kind="stable")[:x]].tolist()) if cands else []
    start = c.n_init + self.formed(n) * c.block_size
    window = list(range(start, n))
    cols = (list(range(min(c.n_init, n))) + [p for j in chosen for p in range(c.n_init + j * c.block_size,
                                                                             c.n_init + (j + 1) * c.block_size)]
            + window + [n])
    out = np.zeros((G, H))
    for g in range(G):
      logits = self.k[cols] @ q_GH[g] / np.sqrt(H)
      p = np.exp(logits - logits.max())
      p /= p.sum()
      out[g] = p @ self.v[cols]
      for col, w in zip(cols, p):
        if col in window or col == n:
          self.score[col] += w / G
    if self.formed(n + 1) > self.formed(n):
      self.form(self.formed(n + 1) - 1)
    return out, chosen


@pytest.mark.parametrize("settings", [dict(budget=14, n_init=2, block_size=3, repr_topk=2, local=6),
                                      dict(budget=20, n_init=2, block_size=3, repr_topk=2)],
                         ids=["local6", "paper_split"])
def test_infllm_attends_initial_window_and_the_blocks_of_best_representatives(settings):
  cfg = infllm.InfLLMConfig(**settings)
  assert (cfg.topk, cfg.window) == ((2, 6) if "local" in settings else (2, 12))
  lengths, steps = np.asarray([4, 15, 22]), 12
  rs = np.random.RandomState(cfg.budget)
  total = int(lengths.max()) + steps
  q_all, k_all, v_all = rs.randn(B, total, N, H), rs.randn(B, total, K, H), rs.randn(B, total, K, H)
  tp = int(lengths.max())
  qp, kp, vp = (jnp.asarray(x[:, :tp], jnp.float32) for x in (q_all, k_all, v_all))
  _, colsum = A.prefill_attention(qp, kp, vp, jnp.asarray(lengths), H ** -0.5, want_colsum=True)
  st = infllm.prefill(cfg, _layer_state(infllm, cfg), kp, vp, jnp.asarray(lengths), colsum)
  refs = [[_RefInfLLM(cfg, k_all[b, :, kh], v_all[b, :, kh], np.asarray(colsum)[b, kh], int(lengths[b]))
           for kh in range(K)] for b in range(B)]
  attend = jax.jit(infllm.attend, static_argnums=0)
  x = st.chosen.shape[-1]
  for i in range(steps):
    n = lengths + i
    out, st, aux = attend(cfg, st, _new_rows(q_all, n), _new_rows(k_all, n), _new_rows(v_all, n), jnp.asarray(n))
    assert aux == {}
    for b in range(B):
      for kh in range(K):
        ref, chosen = refs[b][kh].step(q_all[b, n[b], kh * G:(kh + 1) * G], int(n[b]), x)
        np.testing.assert_allclose(np.asarray(out[b, 0, kh * G:(kh + 1) * G]), ref, atol=1e-5)
        c = refs[b][kh].formed(int(n[b]))
        assert sorted(int(j) for j in np.asarray(st.chosen)[b, kh] if j < c) == chosen, (b, kh, i)
        for j, rep in refs[b][kh].reps.items():
          np.testing.assert_allclose(np.asarray(st.reps)[b, kh, j], rep, atol=1e-5)
  assert max(len(r.reps) for row in refs for r in row) > x           # some blocks were left out


# ---------------------------------------------------------------- through the model

SMALL = dict(n_init=4, block_size=4, repr_topk=2)          # InfLLM's settings at the tiny model's scale


def _teacher_forced(params, cfg, method, prompt, prefix: int):
  """Prefill the prompt's first `prefix` tokens into a 64-slot cache, then decode the rest one token at a time
  -> (each decoded row's logits [T - prefix, V], the cache)."""
  toks = jnp.asarray([prompt])
  _, cache, _ = forward(params, cfg, toks[:, :prefix], init_cache(method, cfg, 1, 64, jnp.float32), method,
                        "prefill")
  got = []
  for t in range(prefix, len(prompt)):
    logits, cache, _ = forward(params, cfg, toks[:, t:t + 1], cache, method, "decode")
    got.append(logits[0, 0])
  return jnp.stack(got), cache


@pytest.mark.parametrize("name, settings", [("quest", dict(budget=32, page_size=4)),
                                             ("infllm", dict(budget=32, **SMALL))], ids=["quest", "infllm"])
def test_budget_covering_the_context_equals_full_at_every_decode_step(name, settings):
  model = tiny_model(seed=22, head_dim=16)
  cfg, params = model.config, model.params
  prompt = random_prompts(22, [24], cfg.vocab_size)[0]
  ref = sj.forward(model, np.asarray([prompt]))[0, -12:]
  got, cache = _teacher_forced(params, cfg, sj.cache_config(name, **settings), prompt, 12)
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
  assert int(cache.lengths[0]) == 24


PROMPT_LENGTHS = [17, 30, 25]          # all pad to width 32 alone: one compiled program per batch size


@pytest.mark.parametrize("name, roomy, small", [
    ("quest", dict(budget=64), dict(budget=16, page_size=4)),                # 4 pages of 4: skips from step 1
    ("infllm", dict(budget=64, **SMALL), dict(budget=20, **SMALL))],         # 4 + a block of 4 + a window of 12
    ids=["quest", "infllm"])
def test_generation_equals_full_at_a_covering_budget_and_ragged_batch_equals_alone(name, roomy, small):
  model = tiny_model(seed=23, head_dim=16)
  prompts = random_prompts(23, PROMPT_LENGTHS, model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=20, stop_tokens=())
  roomy = sj.generate(model, prompts, max_new_tokens=20, stop_tokens=(), cache=sj.cache_config(name, **roomy))
  np.testing.assert_array_equal(roomy.tokens, full.tokens)
  method = sj.cache_config(name, **small)
  batched = sj.generate(model, prompts, max_new_tokens=20, cache=method, stop_tokens=())
  assert not np.array_equal(batched.tokens, full.tokens)
  logits = sj.forward(model, np.asarray([prompts[1] + batched.tokens[1].tolist()]))
  assert np.all(np.isfinite(np.asarray(logits)))
  for i, p in enumerate(prompts):
    alone = sj.generate(model, [p], max_new_tokens=20, cache=method, stop_tokens=())
    np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])


@pytest.mark.parametrize("name, settings", [("quest", dict(budget=8, page_size=4)),
                                             ("infllm", dict(budget=12, **SMALL))], ids=["quest", "infllm"])
def test_a_small_budget_differs_from_full_and_stays_finite(name, settings):
  model = tiny_model(seed=24, head_dim=16)
  cfg, params = model.config, model.params
  prompt = random_prompts(24, [40], cfg.vocab_size)[0]
  ref = sj.forward(model, np.asarray([prompt]))[0, -8:]
  got, _ = _teacher_forced(params, cfg, sj.cache_config(name, **settings), prompt, 32)
  got = np.asarray(got)
  assert np.all(np.isfinite(got)) and np.max(np.abs(got - np.asarray(ref))) > 1e-3


# ---------------------------------------------------------------- configs, bytes and budgets

@pytest.mark.parametrize("settings, match", [
    (dict(budget=0), "budget=0 must be an integer >= 16"),
    (dict(budget=20), "budget=20 must be a multiple of page_size=16"),
    (dict(budget=8, page_size=0), "page_size=0 must be an integer >= 1"),
    (dict(budget=4, page_size=8), "budget=4 must be an integer >= 8"),
    (dict(budget=32.0), "budget=32.0 must be an integer"),
    (dict(budget=32, offload="yes"), "offload='yes' must be a bool"),
    (dict(budget=32, offload=True, host_store="disk"), "host_store='disk' must be one of")])
def test_bad_quest_settings_fail_clearly(settings, match):
  with pytest.raises(ConfigError, match=match):
    sj.cache_config("quest", **settings)


@pytest.mark.parametrize("settings, match", [
    (dict(budget=200), "budget=200 must be an integer >= 256"),
    (dict(budget=64, n_init=-1, block_size=8), "n_init=-1 must be an integer >= 0"),
    (dict(budget=64, block_size=0), "block_size=0 must be an integer >= 1"),
    (dict(budget=64, n_init=4, block_size=8, repr_topk=9), "repr_topk=9 must be <= block_size=8"),
    (dict(budget=64, n_init=4, block_size=8, repr_topk=0), "repr_topk=0 must be an integer >= 1"),
    (dict(budget=64, n_init=4, block_size=8, local=4), "local=4 must be an integer >= 8"),
    (dict(budget=64, n_init=4, block_size=8, local=61), r"n_init=4 \+ local=61 must be <= budget=64"),
    (dict(budget=64, n_init=4, block_size=8, offload=1), "offload=1 must be a bool"),
    (dict(budget=64, n_init=4, block_size=8, offload=True, host_store=None), "host_store=None must be one of")])
def test_bad_infllm_settings_fail_clearly(settings, match):
  with pytest.raises(ConfigError, match=match):
    sj.cache_config("infllm", **settings)


def test_infllm_defaults_are_the_papers():
  method = sj.cache_config("infllm")
  assert (method.n_init, method.block_size, method.repr_topk, method.topk, method.window) == (128, 128, 4, 16, 4096)
  assert method.budget == 128 + 4096 + 16 * 128
  # a smaller budget keeps the paper's split: a third retrieved in whole blocks, the rest the window
  assert (sj.cache_config("infllm", budget=1024).topk, sj.cache_config("infllm", budget=1024).window) == (2, 640)


def test_infllm_bytes_split_between_device_and_host():
  cfg = tiny_model(seed=0, head_dim=16).config
  method = sj.cache_config("infllm", budget=40, **SMALL)                  # 3 blocks, a window of 24
  st = method.impl.init(method, cfg, 2, 100, jnp.bfloat16)
  kv = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2               # bytes per (row, slot) for k and v
  heads = cfg.n_layers * cfg.n_kv_heads
  assert (method.topk, method.window, method.blocks(100)) == (3, 24, 24)
  assert method.host_bytes(st) == 2 * 100 * kv
  assert st.fetched_k.shape[-2] == 4 + 23 + 3 * 4                        # budget - 1: the new row comes apart
  assert method.device_bytes(st) == 2 * (24 * kv // 2 + 39 * kv + heads * (3 * 4 + 24 * 4))
  assert device_bytes_at(method, cfg, 100, jnp.bfloat16, batch=2) == method.device_bytes(st)


def test_quest_bytes_split_between_device_and_host():
  cfg = tiny_model(seed=0, head_dim=16).config
  method = sj.cache_config("quest", budget=32)
  st = method.impl.init(method, cfg, 2, 100, jnp.bfloat16)                 # 112 slots: 7 pages of 16
  kv = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2                # bytes per (row, slot) for k and v
  assert method.slots(100) == 112 and st.kmin.shape[-2] == 7 and st.fetched_k.shape[-2] == 32
  assert method.host_bytes(st) == 2 * 112 * kv
  assert method.device_bytes(st) == 2 * (7 * kv + 32 * kv + cfg.n_layers * cfg.n_kv_heads * 2 * 4)
  assert device_bytes_at(method, cfg, 100, jnp.bfloat16, batch=2) == method.device_bytes(st)
  # a budget over the cache attends all of it
  assert sj.cache_config("quest", budget=1024).pages_chosen(100) == 7


def test_matched_quest_budget_fits_under_the_reference_within_one_page():
  cfg = tiny_model(seed=0, head_dim=16).config
  ref = sj.cache_config("specache", bits=1, group_size=16, residual=16, topk=8)
  budgets = []
  for max_len in (1024, 4096):
    target = device_bytes_at(ref, cfg, max_len, jnp.bfloat16)
    method = matched_budget("quest", ref, cfg, max_len, jnp.bfloat16, page_size=8)
    assert method.name == "quest" and method.page_size == 8 and method.budget % 8 == 0
    assert device_bytes_at(method, cfg, max_len, jnp.bfloat16) <= target
    one_more = sj.cache_config("quest", budget=method.budget + 8, page_size=8)
    assert device_bytes_at(one_more, cfg, max_len, jnp.bfloat16) > target
    budgets.append(method.budget)
  assert budgets[0] < budgets[1]
  # the reference's bytes exceed the whole cache's (bounds + 112 rows): every position is attended
  roomy = matched_budget("quest", sj.cache_config("streaming", budget=200), cfg, 100, jnp.bfloat16)
  assert roomy.budget == 112 and roomy.pages_chosen(100) == 7


def test_matched_infllm_budget_fits_under_the_reference_within_one_token():
  cfg = tiny_model(seed=0, head_dim=16).config
  ref = sj.cache_config("specache", bits=1, group_size=16, residual=16, topk=8)
  for max_len in (1024, 4096):
    target = device_bytes_at(ref, cfg, max_len, jnp.bfloat16)
    method = matched_budget("infllm", ref, cfg, max_len, jnp.bfloat16, **SMALL)
    assert (method.name, method.n_init, method.block_size) == ("infllm", 4, 4)
    assert device_bytes_at(method, cfg, max_len, jnp.bfloat16) <= target
    one_more = sj.cache_config("infllm", budget=method.budget + 1, **SMALL)
    assert device_bytes_at(one_more, cfg, max_len, jnp.bfloat16) > target


@pytest.mark.parametrize("label", ["quest", "infllm"])
def test_the_retrieval_labels_are_sized_to_specache_1bit(label):
  cfg = tiny_model(seed=0, head_dim=64).config
  config = types.SimpleNamespace(methods=dict(methods.standard(), **methods.retrieval()), run_methods=label)
  assert methods.labels(config) == [label]
  method = methods.build(config, label, cfg, 4096, jnp.bfloat16)
  ref = methods.build(config, "specache_1bit", cfg, 4096, jnp.bfloat16)
  target = device_bytes_at(ref, cfg, 4096, jnp.bfloat16)
  assert method.name == label and 16 <= method.budget < 4096
  assert device_bytes_at(method, cfg, 4096, jnp.bfloat16) <= target
