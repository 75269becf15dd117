"""The benchmarks end to end on a tiny random model: well-formed results, byte accounting, the prefilled
states they time, the overlap measurement's range. No timing is asserted."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import caches_bench as caches_cfg
from configs import throughput as throughput_cfg
from experiments.lib.bench import caches, models, overlap, report, states, throughput
import specache_jax as sj
from specache_jax import decode
from specache_jax.caches import METHOD_NAMES
from specache_jax.model.decoder import forward_jit

SMALL = dict(name="specache", bits=1, group_size=8, residual=8, topk=4)


@pytest.fixture(scope="module")
def model():
  return models.load("random:tiny", seed=3)


def _methods_available():
  out = [sj.cache_config("full"), sj.cache_config("kivi", bits=2, group_size=8, residual=16),
         sj.cache_config("specache", bits=1, group_size=8, residual=8, topk=4),
         sj.cache_config("specache", bits=2, group_size=8, residual=8, topk=4, speculative=False),
         sj.cache_config("streaming", budget=24), sj.cache_config("h2o", budget=24)]   # 37 tokens: evicts
  return out


@pytest.mark.parametrize("method", _methods_available(), ids=lambda m: repr(m)[:40])
def test_state_built_from_one_capture_equals_the_decoders_prefill(model, method):
  cfg, params = model.config, model.params
  tokens, lengths = caches.random_prompts(5, 2, 37, cfg.vocab_size)
  lengths = np.asarray([37, 21], np.int32)                                # ragged rows
  max_len = states.cell_slots(37, 8)
  first, cap = states.capture(params, cfg, tokens, lengths)
  built = states.build_cache(cap, jnp.asarray(lengths), cfg=cfg, method=method, max_len=max_len)
  ref = decode.init_cache(method, cfg, 2, max_len, params["embed"].dtype)
  logits, ref, _ = forward_jit(params, cfg, jnp.asarray(tokens), ref, method, "prefill",
                               prompt_lengths=jnp.asarray(lengths), logits_at=jnp.asarray(lengths) - 1)
  np.testing.assert_array_equal(first, np.argmax(np.asarray(logits[:, 0]), axis=-1))
  np.testing.assert_array_equal(built.lengths, ref.lengths)
  for a, b in zip(jax.tree.leaves(built.layers), jax.tree.leaves(ref.layers)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)


def test_capture_row_by_row_equals_one_batch(model):
  cfg, params = model.config, model.params
  tokens, lengths = caches.random_prompts(6, 2, 24, cfg.vocab_size)
  f1, c1 = states.capture(params, cfg, tokens, lengths, rows_at_once=1)
  f2, c2 = states.capture(params, cfg, tokens, lengths, rows_at_once=2)
  np.testing.assert_array_equal(f1, f2)
  for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="rows_at_once"):
    states.capture(params, cfg, tokens, lengths, rows_at_once=3)


def _caches_config(**over):
  c = caches_cfg.get_config("test")
  c.contexts = (64,)
  c.target_context = 64
  c.profile_context = 64
  for k, v in over.items():
    setattr(c, k, v)
  return c


def test_caches_bench_end_to_end(model):
  result = caches.run(_caches_config(max_prefill_s=0), model, log=lambda s: None)  # batch 2 repeats row 0
  result = json.loads(report.dumps(result))                               # JSON-serializable
  assert set(result) >= {"meta", "cells", "target", "profiles"}
  assert [(c["context"], c["batch"]) for c in result["cells"]] == [(64, 1), (64, 2)]
  assert [c["distinct_prompt_rows"] for c in result["cells"]] == [1, 1]
  assert "note" not in result["cells"][0] and "rows repeat" in result["cells"][1]["note"]
  labels = ["full", "kivi_2bit", "specache_1bit", "specache_2bit", "streaming", "h2o", "quest", "infllm"]
  for cell in result["cells"]:
    assert list(cell["methods"]) == labels
    for label, rec in cell["methods"].items():
      assert rec["step"]["median_s"] > 0 and rec["step"]["n"] == 2 and rec["device_bytes"] > 0
    assert cell["methods"]["full"]["step_ratio"] == 1.0
    assert cell["methods"]["full"]["device_bytes_ratio"] == 1.0
    spec = cell["methods"]["specache_1bit"]
    # simulated SpeCache holds its 16-bit "host" cache on the device too: resident > device bytes
    assert spec["resident_bytes"] > spec["device_bytes"]
    assert spec["device_bytes_ratio"] < cell["methods"]["specache_2bit"]["device_bytes_ratio"]
    assert spec["device_bytes_16bit"] < spec["device_bytes"]                   # float32 model here
    assert cell["methods"]["full"]["device_bytes_16bit"] * 2 == cell["methods"]["full"]["device_bytes"]
    for other in ("streaming", "h2o", "quest", "infllm"):   # sized to SpeCache 1-bit's bytes (never above)
      assert 0.9 * spec["device_bytes"] <= cell["methods"][other]["device_bytes"] <= spec["device_bytes"]
      assert cell["methods"][other]["method"]["budget"] >= 1
  assert set(result["target"]["ratios"]) == {"specache_1bit@batch1", "specache_2bit@batch1",
                                             "specache_1bit@batch2", "specache_2bit@batch2"}
  assert result["target"]["met"] in (True, False)
  (prof,) = result["profiles"]
  assert prof["batch"] == 1 and prof["context"] == 64
  assert {"dequantize", "scatter", "top_k", "store_lowbit", "store_16bit", "fetch", "attention"} <= set(prof["pieces"])
  md = report.caches_markdown(result)
  assert "| specache_1bit |" in md and "## Target" in md


def test_caches_bench_out_of_time_cells_are_recorded_as_skipped(model):
  result = caches.run(_caches_config(max_seconds=0, profile_context=0), model, log=lambda s: None)
  for cell in result["cells"]:
    assert "out of time" in cell["skipped"]
  assert result["target"]["met"] is None
  assert "skipped" in report.caches_markdown(result)


def test_transfer_formula_matches_the_state_shapes(model):
  cfg, params = model.config, model.params
  tokens, lengths = caches.random_prompts(7, 2, 112, cfg.vocab_size)     # the shapes of the other tests
  for spec in (dict(SMALL),):
    sim = sj.cache_config(**spec)
    max_len = states.cell_slots(112, 7)
    inp, cache = throughput.prefill_jit(params, jnp.asarray(tokens), jnp.asarray(lengths), cfg=cfg,
                                        method=sim, max_len=max_len)
    f = throughput.transfer_formula(cfg, sim, 2, params["embed"].dtype)
    assert f["h2d"] == 2 * spec["topk"] * cfg.n_kv_heads * cfg.head_dim * 4 * cfg.n_layers * 2
    assert throughput.fetched_bytes(cache.layers) == f["h2d"] and f["d2h"] == 0
    off = sj.cache_config(**spec, offload=True)
    r = spec["residual"]
    drv = throughput.RuntimeDriver(model, off, 2, states.cell_slots(112, r + 1), 112)
    carry = drv.prefill(tokens, lengths)
    written, write_block = [], drv.rt.store.write_block
    drv.rt.store.write_block = lambda l, k, v, *a: (written.append(k.nbytes + v.nbytes), write_block(l, k, v, *a))
    for _ in range(r):                                                      # one ring fill per layer
      carry = drv.step(carry)
    fo = throughput.transfer_formula(cfg, off, 2, params["embed"].dtype)
    assert throughput.fetched_bytes(drv.rt.states) == fo["h2d"] == f["h2d"]
    assert len(written) == cfg.n_layers and sum(written) == fo["d2h"] * r    # a row per step on average
    assert carry[0].shape == (2, 2)
  assert throughput.transfer_formula(cfg, sj.cache_config("full"), 2, jnp.float32) == {"h2d": 0, "d2h": 0}
  assert throughput.transfer_formula(cfg, sj.cache_config(**dict(SMALL, topk=6)), 1, jnp.bfloat16)["h2d"] == \
      2 * 6 * cfg.n_kv_heads * cfg.head_dim * 2 * cfg.n_layers


def test_runtime_driver_with_exact_on_miss_decodes_the_generate_tokens(model):
  """The benchmarks' greedy driver tells the runtime which guesses missed, so an exact_on_miss step is timed
  with its synchronous refetches: its tokens are `generate`'s (offloaded and simulated)."""
  tokens, lengths = caches.random_prompts(9, 2, 40, model.config.vocab_size)
  spec = dict(SMALL, exact_on_miss=True)
  n = 12
  want = sj.generate(model, [list(t) for t in tokens], max_new_tokens=n, stop_tokens=(),
                     cache=sj.cache_config(**spec)).tokens
  drv = throughput.RuntimeDriver(model, sj.cache_config(**spec, offload=True), 2, 64, 40)
  carry = drv.prefill(tokens, lengths)
  got = [np.asarray(carry[0][:, 0])]
  calls, step = [], drv.rt.step
  drv.rt.step = lambda *a: (calls.append(a[3]), step(*a))[1]
  for _ in range(n - 1):
    carry = drv.step(carry)
    got.append(np.asarray(carry[0][:, 0]))
  np.testing.assert_array_equal(np.stack(got, axis=1), np.asarray(want))
  assert calls[0] is None and all(isinstance(m, np.ndarray) and m.shape == (2,) for m in calls[1:])
  assert any(m.any() for m in calls[1:])                                    # some guesses missed
  # ... and counted: the rows whose guesses missed, of the rows stepped with a known miss flag
  assert drv.seen_rows == 2 * (n - 2) and drv.miss_rows == sum(int(m.sum()) for m in calls[1:])


def test_throughput_end_to_end(model):
  c = throughput_cfg.get_config("test")
  c.batches = (2,)
  c.overlap.enabled = False
  result = json.loads(report.dumps(throughput.run(c, model, log=lambda s: None)))
  (cell,) = result["cells"]
  assert list(cell["methods"]) == c.run_methods.split(",")
  for label, rec in cell["methods"].items():
    assert rec["prefill_s"] > 0 and rec["step_s"] > 0
    assert rec["tokens_per_s"] == pytest.approx(2 / rec["step_s"])
    assert rec["h2d_bytes_per_step"] == rec["formula"]["h2d"]
  m = cell["methods"]
  assert m["full"]["tokens_per_s_ratio"] == 1.0 and m["full"]["host_bytes"] == 0
  assert m["specache_offload"]["mode"] == "offload" and m["specache_sim"]["mode"] == "jit"
  assert m["specache_offload"]["host_bytes"] == m["specache_sim"]["host_bytes"] > 0
  assert m["specache_offload"]["device_bytes"] == m["specache_sim"]["device_bytes"]
  assert m["specache_offload"]["d2h_bytes_per_step"] > 0 == m["specache_sim"]["d2h_bytes_per_step"]
  assert "| specache_offload |" in report.throughput_markdown(result)


def test_overlap_measurement_returns_numbers_in_range(model):
  method = sj.cache_config(**SMALL, offload=True)
  out = overlap.measure(model, method, context=128, batch=2, steps=2, rounds=2, warmup=3, margin=16, seed=0)
  for key in ("compute_alone_s", "fetch_alone_s", "pipelined_s"):
    assert out[key] > 0 and len(out["rounds_s"][key[:-2]]) == 2
  assert 0.0 <= out["fraction_hidden"] <= 1.0 and np.isfinite(out["fraction_hidden_raw"])
  r = out["rounds_s"]          # the fraction comes from each round's own a, b, c (median over rounds)
  per_round = [(a + b - c) / b for a, b, c in zip(r["compute_alone"], r["fetch_alone"], r["pipelined"])]
  assert out["fraction_hidden_raw"] == pytest.approx(float(np.median(per_round)))
  lo, hi = out["fraction_hidden_ci90"]                     # a bootstrap interval of that median
  assert min(per_round) <= lo <= out["fraction_hidden_raw"] <= hi <= max(per_round)
  diffs = [c - a for a, c in zip(r["compute_alone"], r["pipelined"])]
  assert out["pipelined_minus_compute_s"] == pytest.approx(float(np.median(diffs)))
  assert 0.0 < out["fetch_issue_s"] and len(out["rounds_s"]["fetch_issue"]) == 2
  # the dispatching thread's CPU per step: positive, at most the pipelined step's wall time (it is part of it)
  assert 0.0 < out["dispatch_cpu_s"] and len(out["rounds_s"]["dispatch_cpu"]) == 2
  assert out["dispatch_cpu_us_per_layer"] == pytest.approx(out["dispatch_cpu_s"] / model.config.n_layers * 1e6)
  with pytest.raises(ValueError, match="offloaded speculative"):
    overlap.measure(model, sj.cache_config(**SMALL), 96, 2, 2, 2, 3, 16, 0)
  with pytest.raises(ValueError, match="offloaded speculative"):
    overlap.measure(model, sj.cache_config(**SMALL, offload=True, speculative=False), 96, 2, 2, 2, 3, 16, 0)


@pytest.mark.parametrize("predecode", [True, False])
def test_nonspeculative_step_times_the_ablation_of_the_same_settings(model, monkeypatch, predecode):
  """The throughput report's non-speculative row: the same SpeCache settings with speculation off (κ_t chosen
  on the critical path), timed through the offloaded runtime."""
  built = []
  real = overlap.RuntimeDriver

  def spy(model_, method, *args):
    built.append(method)
    return real(model_, method, *args)

  monkeypatch.setattr(overlap, "RuntimeDriver", spy)
  method = sj.cache_config(**SMALL, offload=True, predecode=predecode)
  sec = overlap.nonspeculative_step(model, method, context=96, batch=2, steps=2, warmup=2, margin=16, seed=0)
  assert sec > 0
  (ns,) = built
  assert not ns.speculation.speculative and ns.speculation.width == 1
  assert dataclasses.replace(ns, speculation=method.speculation) == method     # nothing else changed


def test_overlap_measurement_runs_without_predecoding(model):
  """Pre-decoding off (the ablation) changes step 1 only: the overlap of the speculative fetch is still measured."""
  method = sj.cache_config(**SMALL, offload=True, predecode=False)
  assert not method.speculation.predecodes
  out = overlap.measure(model, method, context=128, batch=2, steps=2, rounds=2, warmup=3, margin=16, seed=0)
  assert out["fetch_alone_s"] > 0 and 0.0 <= out["fraction_hidden"] <= 1.0


@pytest.mark.parametrize("every", [1, 4])
def test_generate_loop_counts_the_runtimes_host_reads_per_step(model, every):
  """The generate loop's host reads per step are its stop checks: one every `sync_every` steps."""
  out = overlap.generate_loop(model, sj.cache_config(**SMALL, offload=True), context=96, batch=2, tokens=10,
                              repeats=1, margin=16, seed=0, sync_every=every)
  assert out["sync_every"] == every and out["host_reads_per_step"] == pytest.approx(1 / every)
  assert out["dispatch_cpu_us_per_layer"] == pytest.approx(
      out["dispatch_cpu_s"] / model.config.n_layers * 1e6)


def test_resident_store_answers_with_the_rows_it_holds(model):
  """(a) of the overlap measurement runs the pipelined step's programs with rows held on the device: the store
  answers every fetch with the block fetched once, and a step installs exactly those rows."""
  method = sj.cache_config(**SMALL, offload=True)
  tokens, lengths = caches.random_prompts(2, 2, 112, model.config.vocab_size)
  drv = throughput.RuntimeDriver(model, method, 2, 128, 112)
  inp, lens, _, _ = drv.prefill(tokens, lengths)
  res = overlap.ResidentStore.holding_current_rows(drv.rt)
  group = drv.rt.groups[0]
  held = res.fetch(group, tuple(drv.rt.states[l].kappa for l in group)).result()
  assert held is res.fetch(group, ()).result()                                # the same block, every time
  assert res.kind == drv.rt.store.kind and res.nbytes == drv.rt.store.nbytes
  real = drv.rt.store
  drv.rt.store = res
  drv.step((inp, lens, overlap.issue_all_layers(drv.rt), None))
  drv.step((inp, lens, overlap.issue_all_layers(drv.rt), None))               # installed from the held block
  first = held[0] if real.kind == "numpy" else jnp.stack(held[0])            # layer group[0]'s [2, B, K, X, H]
  np.testing.assert_array_equal(np.asarray(drv.rt.states[group[0]].fetched_k), np.asarray(first[0]))


def test_overlap_subprocess_runs_single_threaded_xla_on_one_cpu():
  """XLA's threads on one CPU (pin_xla), so the host store's worker has the others."""
  settings = dict(model="random:tiny", dtype="", seed=0, method=dict(SMALL, offload=True), context=64, batch=1,
                  steps=1, rounds=1, warmup=3, margin=16, nonspeculative=False, stores=["pinned_host", "numpy"],
                  pin_xla=True)
  out = overlap.run_subprocess(settings, single_thread=True, timeout_s=240)
  assert "skipped" not in out, out
  assert overlap.SINGLE_THREAD_XLA in out["xla_flags"]
  assert len(out["xla_cpus"]) == 1 and out["xla_thread_cpus"] == [str(out["xla_cpus"][0])], out
  assert list(out["stores"]) == ["pinned_host", "numpy"]
  for st in out["stores"].values():
    assert st["store"] in ("pinned_host", "numpy") and 0.0 <= st["fraction_hidden"] <= 1.0
    assert 0.0 < st["fetch_issue_s"]


def test_bad_settings_fail_clearly(model):
  with pytest.raises(sj.ConfigError, match="random shape"):
    models.load("random:nope")
  with pytest.raises(ValueError, match="context=16 must exceed margin=16"):
    caches.run(_caches_config(contexts=(16,), profile_context=0), model, log=lambda s: None)
  assert "streaming" in METHOD_NAMES
