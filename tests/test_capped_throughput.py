"""Throughput under a device-memory cap: the max batch is the largest that fits, a batch over the cap is refused,
the GPU config plans without a model, the test variant writes its files; and the one-prefill-per-context
machinery it decodes from (a captured row repeated into a batch) builds the states a real prefill builds."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from configs import capped_throughput as capped_cfg
from experiments.lib.bench import capped_report
from experiments.lib.bench import capped_throughput as ct
from experiments.lib import methods as exp_methods
from experiments.lib.bench import models, states
from experiments.lib.bench.common import random_prompts
from specache_jax.arrays import tree_nbytes
from specache_jax.runtime import OffloadRuntime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny():
  return models.load("tiny-random")


def _sizing(model, config, label, context):
  prompt_len, slots = ct.cell_shape(config, context)
  dtype = model.params["embed"].dtype
  method = exp_methods.build(config, label, model.config, slots, dtype)
  return ct.Sizing(model.config, model.params, method, slots, prompt_len, dtype, int(config.cap_gib * 2**30),
                   int(config.prefill_rows), label)


@pytest.mark.parametrize("predicate,limit,want", [
    (lambda b: b <= 37, 1 << 20, 37), (lambda b: b <= 64, 1 << 20, 64), (lambda b: b <= 1, 100, 1),
    (lambda b: False, 100, 0), (lambda b: True, 100, 100), (lambda b: b <= 5, 3, 3)])
def test_max_batch_search(predicate, limit, want):
  assert ct.max_batch(predicate, limit) == want


def test_max_batch_is_the_largest_that_fits_and_one_more_is_refused(tiny):
  config = capped_cfg.get_config("test")
  cap = int(config.cap_gib * 2**30)
  tops = {}
  for label in exp_methods.labels(config):
    sz = _sizing(tiny, config, label, config.contexts[0])
    top = tops[label] = ct.max_batch(sz.fits)
    assert top >= 1, label
    assert sz.plan(top).device_bytes <= cap < sz.plan(top + 1).device_bytes, label
    assert sz.check(top).device_bytes == sz.parts(top)["device_bytes"]
    with pytest.raises(ct.CapError, match=rf"batch={top + 1} of {label} .* over the cap of .*cap_bytes={cap}\)"
                                          rf".* largest batch that fits is {top}"):
      sz.check(top + 1)
  assert tops["specache_1bit_offload"] > tops["full"]
  # the plan's parts: a jitted method keeps everything on the device, an offloaded one its 16-bit cache on the host
  full = _sizing(tiny, config, "full", config.contexts[0]).parts(2)
  spec = _sizing(tiny, config, "specache_1bit_offload", config.contexts[0]).parts(2)
  assert full["host_bytes"] == 0 and spec["host_bytes"] > spec["cache_bytes"]
  assert full["weights_bytes"] == tree_nbytes(tiny.params)
  with pytest.raises(ValueError, match="cap_bytes=0 must be a positive int"):
    ct.Sizing(tiny.config, tiny.params, sj.cache_config("full"), 64, 32, jnp.float32, 0)


def test_gpu_config_plans_the_papers_setting_without_a_model():
  """Llama-3-8B's shape (bf16), 32k, 48 GiB: planned from shapes (nothing allocated, nothing run)."""
  config = capped_cfg.get_config("gpu")
  config.plan_only = True
  result = ct.run(config, None, log=lambda s: None)
  (ctx,) = result["contexts"]
  assert ctx["context"] == 32768 and "measured" not in ctx
  plans, cap = ctx["plans"], 48 * 2**30
  for label, p in plans.items():
    assert p["max_batch"] >= 1, label
    assert p["at_max"]["device_bytes"] <= cap < p["above_max"]["device_bytes"], label
  assert 14 * 2**30 < plans["full"]["at_max"]["weights_bytes"] < 16 * 2**30
  assert plans["specache_1bit_offload"]["max_batch"] > 5 * plans["full"]["max_batch"]
  text = capped_report.markdown(json.loads(json.dumps(result)))
  assert "Plan only: the max batches from shapes" in text and "| 32768 | specache_1bit_offload |" in text
  with pytest.raises(ValueError, match="needs the model unless config.plan_only"):
    ct.run(capped_cfg.get_config("gpu"), None)


def test_a_repeated_capture_builds_the_states_a_prefill_of_the_repeated_prompt_builds(tiny):
  """The one-prefill-per-context shortcut: a captured row repeated B times (jitted: `build_cache(repeat=)`;
  offloaded: `install_prompt(repeat=)`, host store included) equals prefilling B copies of the prompt."""
  cfg, params = tiny.config, tiny.params
  tokens, lengths = random_prompts(4, 1, 40, cfg.vocab_size)
  batch, slots = 3, states.cell_slots(40, 8)
  toks_B, lens_B = np.repeat(tokens, batch, axis=0), np.repeat(lengths, batch)
  first, cap = states.capture(params, cfg, tokens, lengths)
  first_B, cap_B = states.capture(params, cfg, toks_B, lens_B, rows_at_once=batch)
  np.testing.assert_array_equal(np.repeat(first, batch), first_B)
  full = sj.cache_config("full")
  one = states.build_cache(cap, jnp.asarray(lens_B), cfg=cfg, method=full, max_len=slots, repeat=batch)
  ref = states.build_cache(cap_B, jnp.asarray(lens_B), cfg=cfg, method=full, max_len=slots)
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="rows x repeat=2 make 2"):
    states.build_cache(cap, jnp.asarray(lens_B), cfg=cfg, method=full, max_len=slots, repeat=2)
  method = sj.cache_config("specache", bits=1, group_size=16, residual=16, topk=8, offload=True)
  rts = [OffloadRuntime(params, cfg, method, batch, slots, prompt_len=40) for _ in range(2)]
  rts[0].install_prompt(cap.k, cap.v, jnp.asarray(lens_B), toks_B, repeat=batch)
  rts[1].prefill(jnp.asarray(toks_B), jnp.asarray(lens_B))
  for a, b in zip(jax.tree.leaves(rts[0].states), jax.tree.leaves(rts[1].states)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  for a, b in zip(rts[0].store.arrays(), rts[1].store.arrays()):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  assert np.any(np.asarray(rts[0].store.arrays()[0]))
  with pytest.raises(ValueError, match=r"1 rows x repeat=2 must make the runtime's batch=3"):
    rts[0].install_prompt(cap.k, cap.v, jnp.asarray(lens_B), toks_B, repeat=2)
  for rt in rts:
    rt.store.close()


def test_the_test_variant_writes_its_files(tmp_path):
  out = str(tmp_path / "capped")
  proc = subprocess.run([sys.executable, "-m", "experiments.capped_throughput",
                         "--config=configs/capped_throughput.py:test", f"--config.out={out}"],
                        cwd=ROOT, capture_output=True, text=True, env=dict(os.environ), timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(open(out + ".json").read())
  meta = result["meta"]
  assert meta["command"].startswith("python -m experiments.capped_throughput") and meta["commit"]
  assert meta["machine_start"]["load_average_1_5_15"] and meta["machine_start"]["time"]
  assert "nothing limits the process to the cap" in meta["cap_note"]
  (ctx,) = result["contexts"]
  for label, plan in ctx["plans"].items():
    rows = ctx["measured"]["methods"][label]
    assert rows[0]["is_max"] and rows[0]["batch"] == plan["max_batch"], label
    assert all("tokens_per_s" in r for r in rows), (label, rows)
    assert all(r["planned_device_bytes"] <= meta["cap_bytes"] for r in rows)
    assert plan["tokens_per_s_at_max"] > 0
  assert ctx["plans"]["full"]["tokens_per_s_ratio"] == 1.0
  full_rows = ctx["measured"]["methods"]["full"]       # the plan's state bytes are the real state's
  assert full_rows[0]["state_bytes_measured"] == ctx["plans"]["full"]["at_max"]["cache_bytes"]
  text = open(out + ".md").read()
  assert "nothing limits the process to the cap" in text and "| specache_1bit_offload |" in text
  assert os.path.getsize(out + ".png") > 1000 and "](capped.png)" in text
  assert proc.stdout.startswith("# Decode throughput under a 3 MiB device-memory cap")


def test_a_context_with_no_time_left_is_not_prefilled(tiny):
  config = capped_cfg.get_config("test")
  out = ct.measure_context(config, tiny, config.contexts[0], {"full": {"max_batch": 1}}, 0.0, lambda s: None)
  assert out == {"skipped": "out of time (config.max_seconds) before the prefill", "methods": {}}
  config.plan_only = True
  result = ct.run(config, tiny, lambda s: None)
  result["contexts"][0]["measured"] = dict(out, methods={"full": [{"batch": 1, "is_max": True,
                                                                  "skipped": "out of time (config.max_seconds)"}]})
  assert "160: out of time (config.max_seconds) before the prefill" in capped_report.markdown(result)
