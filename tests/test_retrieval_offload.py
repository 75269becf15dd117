"""Quest and InfLLM offloaded (`offload=True`): the 16-bit cache in the host store, their rows fetched through the
SpeCache runtime. Same tokens as simulated; the full cache's at a covering budget; the host store holds the
rows the simulated cache holds wherever a fetch can read them; bytes split between device and host; each layer's
fetch on the critical path (no speculative token)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax.caches.budget import device_bytes_at
from specache_jax.decode import init_cache
from specache_jax.model.decoder import forward_jit as forward
from specache_jax.runtime import OffloadRuntime
from tests.tiny import random_prompts, tiny_model

SMALL = dict(n_init=4, block_size=4, repr_topk=2)          # InfLLM's settings at the tiny model's scale
SETTINGS = {                                               # budgets well under the prompts: rows are skipped
    "quest": dict(budget=16, page_size=4),
    "infllm": dict(budget=20, **SMALL),                    # 4 initial + a block of 4 + a window of 12
    "infllm_local": dict(budget=14, n_init=2, block_size=3, repr_topk=2, local=6),   # 2 blocks, window 6
}
PROMPTS = [12, 37, 25]


def _model():
  return tiny_model(seed=31, head_dim=16)


def _method(label, **kw):
  return sj.cache_config(label.split("_")[0], **SETTINGS[label], **kw)


@pytest.mark.parametrize("label, store", [("quest", "numpy"), ("quest", "pinned_host"), ("infllm", "numpy"),
                                          ("infllm_local", "pinned_host")], ids=lambda x: str(x))
def test_offloaded_tokens_equal_simulated(label, store):
  model = _model()
  prompts = random_prompts(7, PROMPTS, model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=32, stop_tokens=())
  sim = sj.generate(model, prompts, max_new_tokens=32, cache=_method(label), stop_tokens=())
  off = sj.generate(model, prompts, max_new_tokens=32, cache=_method(label, offload=True, host_store=store),
                    stop_tokens=())
  assert not np.array_equal(sim.tokens, full.tokens)                      # the budget skips rows
  np.testing.assert_array_equal(off.tokens, sim.tokens)


@pytest.mark.parametrize("name, settings", [("quest", dict(budget=128, page_size=4)),
                                             ("infllm", dict(budget=96, **SMALL))], ids=["quest", "infllm"])
def test_offloaded_at_a_covering_budget_equals_the_full_cache(name, settings):
  model = _model()
  prompts = random_prompts(8, PROMPTS, model.config.vocab_size)
  full = sj.generate(model, prompts, max_new_tokens=24, stop_tokens=())
  off = sj.generate(model, prompts, max_new_tokens=24, stop_tokens=(),
                    cache=sj.cache_config(name, offload=True, **settings))
  np.testing.assert_array_equal(off.tokens, full.tokens)


def _simulated_k16(model, method, tokens, prompt_len, max_len):
  """The simulated cache's 16-bit keys [L, 1, K, S, H] after teacher-forcing `tokens` (one row)."""
  cfg = model.config
  toks = jnp.asarray([tokens])
  _, cache, _ = forward(model.params, cfg, toks[:, :prompt_len], init_cache(method, cfg, 1, max_len, jnp.float32),
                        method, "prefill")
  for t in range(prompt_len, len(tokens)):
    _, cache, _ = forward(model.params, cfg, toks[:, t:t + 1], cache, method, "decode")
  return np.asarray(cache.layers.k16)


@pytest.mark.parametrize("label", ["quest", "infllm"])
def test_the_host_store_holds_every_row_a_fetch_can_read_and_each_layer_waits_for_its_own(label):
  """After decoding, the host's 16-bit keys equal the simulated cache's at every position the device does not
  hold (Quest: all pages before the current one; InfLLM: every block out of the window): flushed a page / a
  block at a time, never a row per step. Every decoding step fetches layer by layer (critical path)."""
  model = _model()
  cfg = model.config
  prompt = random_prompts(9, [21], cfg.vocab_size)[0]
  method = _method(label, offload=True, host_store="numpy")
  max_len, steps = 80, 30
  rt = OffloadRuntime(model.params, cfg, method, batch=1, max_len=max_len)
  assert not rt.prefetches
  fetches, writes = [], []
  rt._init = (lambda init: lambda: (init(), record()))(rt._init)

  def record():
    fetch, write_block = rt.store.fetch, rt.store.write_block
    rt.store.fetch = lambda layers, idx: (fetches.append(tuple(layers)), fetch(layers, idx))[1]
    rt.store.write_block = lambda *a: (writes.append(a[0]), write_block(*a))
  toks, lens = sj.pad_prompts([prompt])
  out = rt.generate(toks, lens, steps, jax.random.key(0))
  assert fetches == [(l,) for _ in range(steps - 1) for l in range(cfg.n_layers)]
  stored = len(prompt) + steps - 1
  if label == "quest":
    held_on_host = stored // method.page_size * method.page_size          # pages before the current one
    blocks = held_on_host // method.page_size - len(prompt) // method.page_size
  else:
    formed = (stored - method.n_init - method.window + method.block_size) // method.block_size
    held_on_host = method.n_init + formed * method.block_size             # every block out of the window
    blocks = formed - max(0, (len(prompt) - method.n_init - method.window + method.block_size) // method.block_size)
  assert blocks >= 2 and len(writes) == blocks * cfg.n_layers             # one write per layer per block
  k16 = _simulated_k16(model, _method(label), prompt + out.tokens[0, :steps - 1].tolist(), len(prompt), max_len)
  host_k = rt.store.arrays()[:cfg.n_layers]                               # K of each layer, [B, K, S, H]
  for l in range(cfg.n_layers):
    np.testing.assert_allclose(np.asarray(host_k[l])[0, :, :held_on_host], k16[l, 0, :, :held_on_host],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("label", ["quest", "infllm"])
def test_offloaded_bytes_split_between_device_and_host(label):
  model = _model()
  cfg, batch, max_len = model.config, 2, 96
  sim, off = _method(label), _method(label, offload=True)
  rt = OffloadRuntime(model.params, cfg, off, batch=batch, max_len=max_len)
  toks, lens = sj.pad_prompts(random_prompts(10, [30, 17], cfg.vocab_size))
  rt.generate(toks, lens, 4, jax.random.key(0))
  slots = off.slots(max_len)
  row = cfg.n_kv_heads * cfg.head_dim * 4                                 # float32 bytes per (layer, row, slot)
  assert rt.store.nbytes == rt.plan.host_bytes == 2 * cfg.n_layers * batch * slots * row
  assert all(st.k16.shape[2] == 0 for st in rt.states)                    # no 16-bit cache on the device
  assert rt.device_bytes() == device_bytes_at(off, cfg, max_len, jnp.float32, batch=batch)
  extra = 0 if label == "quest" else 2 * cfg.n_layers * batch * row       # InfLLM's ring: one row more
  assert rt.device_bytes() == device_bytes_at(sim, cfg, max_len, jnp.float32, batch=batch) + extra
  assert off.host_bytes(rt.states) == 0                                   # the store holds them, not the state
