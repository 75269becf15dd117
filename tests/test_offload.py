"""The offloaded runtime: same tokens as the simulated path; host memory kinds; asynchrony; memory plan."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import offload
from specache_jax.runtime import OffloadRuntime
from tests.tiny import random_prompts, tiny_model


def _model():
  return tiny_model(seed=31, head_dim=16)


@pytest.mark.parametrize("bits,speculative,store,lengths", [
    (1, True, "pinned_host", [37]),
    (2, True, "numpy", [37]),
    (2, False, "pinned_host", [37]),
    (1, True, "pinned_host", [12, 37, 25]),
    (1, False, "numpy", [12, 37, 25]),
], ids=lambda x: f"{x}")
def test_offloaded_tokens_equal_simulated(bits, speculative, store, lengths):
  model = _model()
  prompts = random_prompts(7, lengths, model.config.vocab_size)
  kw = dict(bits=bits, group_size=8, residual=8, topk=4, speculative=speculative)
  sim = sj.generate(model, prompts, max_new_tokens=32, cache=sj.cache_config("specache", **kw), stop_tokens=())
  off = sj.generate(model, prompts, max_new_tokens=32, stop_tokens=(),
                    cache=sj.cache_config("specache", offload=True, host_store=store, **kw))
  np.testing.assert_array_equal(off.tokens, sim.tokens)


@pytest.mark.parametrize("store", ["pinned_host", "numpy"])
def test_ring_flush_block_writes_give_the_host_the_rows_per_row_writes_would(store):
  """Decoded rows reach the host a ring block at a time. In the same run, a per-row record (each step's real
  row, read from the device ring right after the step) agrees with the store on every decoded position an
  attend can read from κ (below its 16-bit ring keys, key_qlen), per batch row (ragged: rows flush at
  different steps); one block write per layer per row per ring fill."""
  from specache_jax.caches import lowbit
  model = _model()
  cfg = model.config
  prompts = random_prompts(14, [12, 37, 26], cfg.vocab_size)
  toks, lens = sj.pad_prompts(prompts)
  r = 8
  rt = OffloadRuntime(model.params, cfg, sj.cache_config("specache", bits=1, group_size=8, residual=r, topk=4,
                                                         offload=True, host_store=store), batch=3, max_len=96)
  writes, per_row = [], np.zeros((2, cfg.n_layers, 3, cfg.n_kv_heads, 96, cfg.head_dim), np.float32)

  def recording():
    write_block = rt.store.write_block
    rt.store.write_block = lambda *a: (writes.append(list(a[4])), write_block(*a))
  rt._init = (lambda init: lambda: (init(), recording()))(rt._init)
  step = rt.step

  def step_and_record(inp, lengths, *a):
    out = step(inp, lengths, *a)
    pos = np.asarray(lengths)
    for l, st in enumerate(rt.states):
      for kv, ring in enumerate((np.asarray(st.low.ring_k), np.asarray(st.low.ring_v))):   # [B, K, R, H]
        for b, p in enumerate(pos):
          per_row[kv, l, b, :, p] = ring[b, :, p % r]
    return out
  rt.step = step_and_record
  steps = 20
  rt.generate(toks, lens, steps, jax.random.key(0))
  stored = np.asarray(lens) + steps - 1
  key_qlen = np.asarray(lowbit.boundaries(jnp.asarray(stored), r)[0])
  arrays = rt.store.arrays()                                                # after the queued writes: K..., V...
  for kv, l in itertools.product(range(2), range(cfg.n_layers)):
    host = np.asarray(arrays[kv * cfg.n_layers + l])
    for b, n in enumerate(np.asarray(lens)):
      assert key_qlen[b] > n                                                # some decoded rows were flushed
      np.testing.assert_array_equal(host[b, :, n:key_qlen[b]], per_row[kv, l, b, :, n:key_qlen[b]])
      unwritten = host[b, :, max(key_qlen[b], toks.shape[1]):stored[b]]    # past the padded prompt's rows
      assert not np.any(unwritten)                                          # not yet: still in the ring
  fills = sum(int(s // r - n // r) for s, n in zip(stored, np.asarray(lens)))
  assert sum(len(w) for w in writes) == fills * cfg.n_layers               # one write per row per ring fill
  assert len(writes) < (steps - 1) * cfg.n_layers                          # not a write every step


def _runtime(store="pinned_host", topk=4):
  model = _model()
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=topk, offload=True,
                           host_store=store)
  rt = OffloadRuntime(model.params, model.config, method, batch=2, max_len=128)
  return model, method, rt


def test_host_arrays_live_in_pinned_host_memory_and_device_holds_few_16bit_rows():
  model, method, rt = _runtime()
  toks, lens = sj.pad_prompts(random_prompts(8, [40, 21], model.config.vocab_size))
  rt.generate(toks, lens, 8, jax.random.key(0))
  assert all(a.sharding.memory_kind == "pinned_host" for a in rt.store.arrays())
  assert rt.store.nbytes == 2 * model.config.n_layers * 2 * model.config.n_kv_heads * 128 * 16 * 4
  limit = method.topk + method.residual + 2
  for st in rt.states:
    assert st.k16.shape[2] == 0 and st.v16.shape[2] == 0
    rows_16bit = {"ring": st.low.ring_k.shape[2], "fetched": st.fetched_k.shape[2]}
    assert sum(rows_16bit.values()) <= limit, rows_16bit                  # per layer per KV head, K and V
    assert st.low.k_codes.dtype == jnp.uint8 and st.low.v_codes.dtype == jnp.uint8
    assert all(leaf.sharding.memory_kind == "device" for leaf in jax.tree.leaves(st))


def test_numpy_fallback_store_is_selected_by_config():
  model, _, rt = _runtime(store="numpy")
  toks, lens = sj.pad_prompts(random_prompts(8, [40, 21], model.config.vocab_size))
  rt.generate(toks, lens, 4, jax.random.key(0))
  assert rt.store.kind == "numpy" and all(isinstance(a, np.ndarray) for a in rt.store.arrays())


def test_fetch_returns_before_its_data_is_ready_and_is_right_after():
  store = offload.PinnedHostStore(1, 2, 3, 4096, 64, jnp.float32)
  rs = np.random.RandomState(0)
  k = rs.randn(2, 4096, 3, 64).astype(np.float32)
  store.write_prompt(0, jnp.asarray(k), jnp.asarray(-k))
  kappa = jnp.asarray(rs.randint(0, 4096, size=(2, 3, 512)), jnp.int32)
  jax.block_until_ready(store.k[0])
  (k_rows, v_rows), = store.fetch((0,), (kappa,)).result()
  was_ready = k_rows.is_ready()
  expect = np.take_along_axis(k.swapaxes(1, 2), np.asarray(kappa)[..., None], axis=2)
  np.testing.assert_array_equal(np.asarray(k_rows), expect)
  np.testing.assert_array_equal(np.asarray(v_rows), -expect)
  assert k_rows.sharding.memory_kind == "device"
  # asynchronous dispatch: the call returned before the gather + transfer finished (report if it raced)
  if was_ready:
    pytest.skip("the fetch finished before is_ready() was polled; asynchrony not observable this time")


def test_memory_plan_fails_up_front_with_numbers():
  model = _model()
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4, offload=True)
  plan = offload.plan_memory(model.config, method, model.params, 1, 512, jnp.float32, 100,
                             host_available=1000, device_available=10**12)
  with pytest.raises(offload.MemoryPlanError, match=r"needs .* GiB .* only .* GiB"):
    plan.check()
  ok = offload.plan_memory(model.config, method, model.params, 1, 512, jnp.float32, 100,
                           host_available=10**12, device_available=10**12)
  ok.check()
  assert ok.host_bytes == 2 * 2 * 1 * 2 * 512 * 16 * 4


def test_runtime_rejects_a_non_offload_config():
  model = _model()
  with pytest.raises(ValueError, match="offload=True"):
    OffloadRuntime(model.params, model.config, sj.cache_config("specache", group_size=8, residual=8, topk=4),
                   1, 64)


def test_memory_plan_refuses_8b_at_32k_batch_25_over_the_pinned_pool_cap():
  """Llama-3-8B (bf16) at 32k x batch 25 holds 100 GiB of 16-bit KV: on a GPU host with 128 GiB of RAM it fits
  pageable memory (numpy store) but not XLA's 64 GiB pinned pool (pinned_host store): refused up front, with
  the numbers, before anything is allocated (params are shapes only). On the device side the prefill's
  activations (one layer at a time, MLP in row pieces, blockwise attention) put it at ~79 GiB: it fits an H200."""
  from experiments.lib.models import SHAPES
  from specache_jax.model.init import init_params
  from specache_jax.model_config import ModelConfig
  cfg = ModelConfig(**SHAPES["llama3-8b"], name="llama3-8b")
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16))
  plans = {}
  for store in ("pinned_host", "numpy"):
    method = sj.cache_config("specache", bits=1, group_size=64, residual=64, topk=64, offload=True,
                             host_store=store)
    plans[store] = offload.plan_memory(cfg, method, params, 25, 32768, jnp.bfloat16, 32768, platform="gpu",
                                       host_available=128 * 2**30, device_available=None,
                                       pinned_limit=64 * 2**30)
  assert plans["pinned_host"].host_bytes == 25 * 32768 * 2 * 32 * 8 * 128 * 2 == 100 * 2**30
  with pytest.raises(offload.MemoryPlanError,
                     match=r"needs 100\.00 GiB of pinned host memory .* capped at 64\.00 GiB .*"
                           r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
    plans["pinned_host"].check()
  assert plans["numpy"].store == "numpy"
  plans["numpy"].check()                                                   # pageable RAM: 100 <= 128 GiB
  on_h200 = offload.plan_memory(cfg, method, params, 25, 32768, jnp.bfloat16, 32768, platform="gpu",
                                host_available=128 * 2**30, device_available=141 * 10**9)
  assert 70 * 2**30 < on_h200.device_bytes < 90 * 2**30                     # weights 15 GiB + prefill ~55 GiB
  on_h200.check()


def test_memory_plan_prefills_in_sequence_chunks_that_fit_and_refuses_when_one_does_not():
  """Llama-3-8B (bf16) at 32k x batch 25 on a 48 GB accelerator (the paper's A6000 setting): the whole batch's
  prefill activations (~55 GiB) do not fit next to the weights, so the plan prefills fewer sequences at a time —
  the most that fit; on 20 GB even one sequence's do not: refused up front, with the numbers."""
  from experiments.lib.models import SHAPES
  from specache_jax.model.init import init_params
  from specache_jax.model_config import ModelConfig
  cfg = ModelConfig(**SHAPES["llama3-8b"], name="llama3-8b")
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16))
  method = sj.cache_config("specache", bits=1, group_size=64, residual=64, topk=64, offload=True)
  kw = dict(platform="gpu", host_available=128 * 2**30, pinned_limit=64 * 2**30)
  plan = offload.plan_memory(cfg, method, params, 25, 32768, jnp.bfloat16, 32768, device_available=48 * 10**9, **kw)
  assert 1 <= plan.prefill_rows < 25
  plan.check()
  one_more = offload.plan_memory(cfg, method, params, 25, 32768, jnp.bfloat16, 32768, device_available=48 * 10**9,
                                 prefill_rows=plan.prefill_rows + 1, **kw)
  assert one_more.device_bytes > 48 * 10**9 > plan.device_bytes                  # the most that fit
  assert plan.activation_bytes == offload.prefill_activation_bytes(cfg, plan.prefill_rows, 32768, jnp.bfloat16)
  tight = offload.plan_memory(cfg, method, params, 25, 32768, jnp.bfloat16, 32768, device_available=20 * 10**9,
                              **kw)
  assert tight.prefill_rows == 1
  with pytest.raises(offload.MemoryPlanError, match=r"needs .* GiB of accelerator memory \(of which the "
                                                    r"prefill's activations for 1 sequence\(s\) at a time: .* GiB\)"):
    tight.check()
  for bad in (0, 26, 2.0, True):
    with pytest.raises(ValueError, match="prefill_rows"):
      offload.plan_memory(cfg, method, params, 25, 32768, jnp.bfloat16, 32768, prefill_rows=bad, **kw)


@pytest.mark.parametrize("store,prefill_rows", [("numpy", 1), ("pinned_host", 2)])
def test_prefill_in_sequence_chunks_gives_the_same_tokens_and_host_cache(store, prefill_rows):
  model = _model()
  prompts = random_prompts(17, [12, 37, 25], model.config.vocab_size)
  toks, lens = sj.pad_prompts(prompts)
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4, offload=True, host_store=store)
  out, host = {}, {}
  for rows in (None, prefill_rows):
    rt = OffloadRuntime(model.params, model.config, method, batch=3, max_len=96, prefill_rows=rows)
    assert rt.plan.prefill_rows == (rows or 3)
    out[rows] = rt.generate(toks, lens, 12, jax.random.key(0)).tokens
    host[rows] = [np.asarray(a) for a in rt.store.arrays()]
  np.testing.assert_array_equal(out[prefill_rows], out[None])
  for a, b in zip(host[prefill_rows], host[None]):     # float32 rounding of a different batch shape only
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert np.any(host[None][0])


def test_pinned_pool_cap_comes_from_the_environment(monkeypatch):
  assert offload.pinned_limit_bytes("cpu") is None
  monkeypatch.delenv(offload.PINNED_LIMIT_ENV, raising=False)
  assert offload.pinned_limit_bytes("gpu") == 64 * 2**30
  monkeypatch.setenv(offload.PINNED_LIMIT_ENV, "96")
  assert offload.pinned_limit_bytes("gpu") == 96 * 2**30
  monkeypatch.setenv(offload.PINNED_LIMIT_ENV, "lots")
  with pytest.raises(offload.MemoryPlanError, match="must be a number of GiB"):
    offload.pinned_limit_bytes("gpu")


class _RecordingStore:
  """Wraps a host store; logs ("fetch", n, layers) when a fetch is issued and ("wait", n, layers) when the
  runtime asks for its rows (n numbers the fetches in issue order)."""

  def __init__(self, store, log):
    self._store, self.log, self._n = store, log, 0

  def fetch(self, layers, kappas):
    n, self._n = self._n, self._n + 1
    self.log.append(("fetch", n, tuple(layers)))
    pending, log = self._store.fetch(layers, kappas), self.log

    class Waited:
      def result(self):
        log.append(("wait", n, tuple(layers)))
        return pending.result()
    return Waited()

  def __getattr__(self, name):
    return getattr(self._store, name)


@pytest.mark.parametrize("store,n_layers,groups", [("pinned_host", 2, 5), ("numpy", 4, 2), ("numpy", 5, 2)])
def test_each_fetch_is_issued_before_the_next_group_and_waited_on_only_a_step_later(store, n_layers, groups):
  """The pipeline's order, from the calls themselves (not timing): during step t, layer group g's fetch of
  κ_{t+1} is issued right after group g and before group g+1 waits for anything; the first wait on it comes in
  step t+1, after every group of step t has issued its own fetch. Groups are runs of consecutive layers that
  cover every layer once (2 layers in 5 groups: one layer each)."""
  model = tiny_model(seed=31, head_dim=16, n_layers=n_layers)
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4, offload=True, host_store=store)
  rt = OffloadRuntime(model.params, model.config, method, batch=2, max_len=128, dispatch_groups=groups)
  assert [l for g in rt.groups for l in g] == list(range(n_layers))
  assert len(rt.groups) == min(groups, n_layers) and max(map(len, rt.groups)) - min(map(len, rt.groups)) <= 1
  toks, lens = sj.pad_prompts(random_prompts(8, [40, 21], model.config.vocab_size))
  log, n_groups = [], len(rt.groups)
  rt._init = (lambda init: lambda: (init(), setattr(rt, "store", _RecordingStore(rt.store, log))))(rt._init)
  out = rt.generate(toks, lens, 6, jax.random.key(0))
  assert out.tokens.shape == (2, 6)
  issued = {n: i for i, (kind, n, _) in enumerate(log) if kind == "fetch"}
  waited = {n: i for i, (kind, n, _) in enumerate(log) if kind == "wait"}
  group_of = {n: rt.groups.index(layers) for kind, n, layers in log if kind == "fetch"}
  assert waited and set(waited) <= set(issued)
  for n, w in waited.items():
    pass_of_n = n // n_groups                               # fetches come n_groups per pass (pre-decoding first)
    last_of_pass = (pass_of_n + 1) * n_groups - 1
    assert issued[last_of_pass] < w, f"fetch {n} (group {group_of[n]}) waited on before its pass ended"
    between = [m for kind, m, _ in log[issued[n]:w] if kind == "fetch"]
    assert len(between) >= n_groups - group_of[n], "groups after g did not issue their fetches first"
  for n, i in issued.items():   # group g's fetch is issued before group g+1 takes its own rows of this step
    nxt = n - n_groups + 1                                 # the fetch (previous pass) group g+1 waits on now
    if group_of[n] < n_groups - 1 and nxt in waited:
      assert i < waited[nxt], f"group {group_of[n] + 1} waited before group {group_of[n]}'s fetch was issued"
  for n in range(len(issued) - 1):                         # issue order: group by group within a pass
    assert group_of[n + 1] == (group_of[n] + 1) % n_groups


def test_numpy_store_fetches_a_group_of_layers_as_one_block():
  store = offload.NumpyHostStore(3, 2, 3, 50, 8, jnp.float32)
  rs = np.random.RandomState(3)
  k, v = rs.randn(3, 2, 50, 3, 8).astype(np.float32), rs.randn(3, 2, 50, 3, 8).astype(np.float32)
  for l in range(3):
    store.write_prompt(l, jnp.asarray(k[l]), jnp.asarray(v[l]))
  kappas = [jnp.asarray(rs.randint(0, 50, size=(2, 3, 5)), jnp.int32) for _ in range(2)]
  rows = store.fetch((1, 2), kappas).result()
  assert rows.shape == (2, 2, 2, 3, 5, 8)                   # [G, K/V, B, K, X, H]
  for i, l in enumerate((1, 2)):
    idx = np.asarray(kappas[i])[..., None]
    np.testing.assert_array_equal(np.asarray(rows[i, 0]), np.take_along_axis(k[l].swapaxes(1, 2), idx, axis=2))
    np.testing.assert_array_equal(np.asarray(rows[i, 1]), np.take_along_axis(v[l].swapaxes(1, 2), idx, axis=2))
  with pytest.raises(ValueError, match="consecutive layers"):
    store.fetch((0, 2), kappas)
  store.close()


def test_gathered_rows_become_the_device_array_without_a_copy_on_cpu():
  """take_rows gathers into a new 64-byte-aligned array (clipped slots as attention.gather_rows), which the CPU
  backend's device_put(may_alias=True) uses as the device buffer itself: the fetch copies each row once."""
  rs = np.random.RandomState(0)
  buf = rs.randn(2, 3, 40, 16).astype(np.float32)
  idx = rs.randint(-3, 45, size=(2, 3, 7))
  rows = offload.take_rows(buf, idx)
  assert rows.ctypes.data % 64 == 0
  np.testing.assert_array_equal(rows, np.take_along_axis(buf, np.clip(idx, 0, 39)[..., None], axis=2))
  for shape in [(5,), (3, 7, 9), (0, 4)]:
    a = offload.aligned_empty(shape, np.float32)
    assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous
    assert a.size == 0 or a.ctypes.data % 64 == 0
  if jax.default_backend() == "cpu":
    on_device = jax.device_put(rows, jax.devices()[0], may_alias=True)
    assert on_device.unsafe_buffer_pointer() == rows.ctypes.data


@pytest.mark.parametrize("groups", [0, -1, 1.5, True])
def test_dispatch_groups_must_be_a_positive_int(groups):
  model = _model()
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4, offload=True)
  with pytest.raises(ValueError, match="dispatch_groups"):
    OffloadRuntime(model.params, model.config, method, batch=1, max_len=64, dispatch_groups=groups)


@pytest.mark.parametrize("batch, prompt_len", [(1, 40), (2, 700)])     # one tile; 3 query blocks, 2 row pieces
def test_prefill_activation_estimate_bounds_what_xla_allocates_for_a_prefill_layer(batch, prompt_len):
  """The memory plan's activation term vs XLA's own memory analysis of the runtime's compiled prefill layer
  (its temporaries + the hidden state in + its outputs): at least that, and not more than twice."""
  from specache_jax import runtime
  from specache_jax.model import decoder as dec
  model = _model()
  cfg = model.config
  method = sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4, offload=True)
  st = jax.eval_shape(lambda: jax.tree.map(lambda a: a[0], method.impl.init(method, cfg, batch, prompt_len,
                                                                            jnp.float32)))
  lp = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), model.params["layers"])
  x = jax.ShapeDtypeStruct((batch, prompt_len, cfg.dim), jnp.float32)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  rope = jax.eval_shape(lambda n: dec.rope_for(cfg, "prefill", n, prompt_len), lengths)
  mem = runtime._prefill_layer.lower(lp, x, lengths, rope, st, cfg=cfg, method=method).compile().memory_analysis()
  xla = mem.temp_size_in_bytes + mem.output_size_in_bytes + batch * prompt_len * cfg.dim * 4
  est = offload.prefill_activation_bytes(cfg, batch, prompt_len, jnp.float32)
  assert xla <= est <= 2 * xla, (xla, est)
