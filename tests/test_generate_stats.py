"""`sj.generate(..., return_stats=True)`: the call's timing (time to first token, decode tokens/s, wall) and the
part of it spent compiling, counted from JAX's own compile events; a second identical call compiles nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import clock
from tests.tiny import random_prompts, tiny_model

TIMING = ("wall_s", "ttft_s", "decode_s", "decode_tokens_per_s", "compile_s", "compilations")
SMALL = dict(bits=1, group_size=8, residual=8, topk=4)
METHODS = {
    "full": lambda: sj.cache_config("full"),
    "specache": lambda: sj.cache_config("specache", **SMALL),
    "specache_offloaded": lambda: sj.cache_config("specache", offload=True, **SMALL),
    "robust_offloaded": lambda: sj.cache_config("specache", preset="robust", **dict(SMALL, topk=8), offload=True),
}


def test_union_seconds_counts_overlapping_spans_once():
  assert clock.union_seconds([]) == 0.0
  assert clock.union_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
  assert clock.union_seconds([(0.0, 2.0), (0.5, 1.0)]) == 2.0                  # a trace nested in another
  assert clock.union_seconds([(0.0, 2.0), (1.0, 3.0)], since=1.5, until=2.5) == 1.0
  assert clock.union_seconds([(0.0, 1.0)], since=2.0) == 0.0


def test_compile_log_counts_the_programs_jax_builds():
  f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
  x7, x8 = jnp.ones(7), jnp.ones(8)
  with clock.CompileLog() as first:
    jax.block_until_ready(f(x7))
  with clock.CompileLog() as again:
    jax.block_until_ready(f(x7))
  with clock.CompileLog() as other_shape:
    jax.block_until_ready(f(x8))
  assert first.count("compile") == 1 and first.count("trace") >= 1 and first.seconds() > 0.0
  assert again.spans == [] and again.seconds() == 0.0
  assert other_shape.count("compile") == 1
  assert clock._open_logs == []                                               # every log closed


@pytest.mark.parametrize("name", list(METHODS))
def test_a_second_identical_call_compiles_nothing_and_reports_its_timing(name):
  model = tiny_model(seed=23, head_dim=16)
  prompts = random_prompts(5, [29, 18], model.config.vocab_size)
  new = 9
  run = lambda: sj.generate(model, prompts, max_new_tokens=new, cache=METHODS[name](), stop_tokens=(),
                            return_stats=True)
  out_1, first = run()
  out_2, again = run()
  np.testing.assert_array_equal(np.asarray(out_2.tokens), np.asarray(out_1.tokens))
  assert set(TIMING) <= set(first) and set(TIMING) <= set(again)
  assert first["compilations"] > 0 and first["compile_s"] > 0.0
  assert again["compilations"] == 0 and again["compile_s"] == 0.0, again
  decoded = 2 * (new - 1)                                        # no stop tokens: every row decodes to the end
  for s in (first, again):
    assert 0.0 < s["ttft_s"] and 0.0 < s["decode_s"]
    assert s["ttft_s"] + s["decode_s"] <= s["wall_s"] + 1e-6
    assert s["compile_s"] <= s["wall_s"]
    assert s["decode_tokens_per_s"] >= decoded / s["decode_s"] * (1 - 1e-9)   # compile seconds left out
  assert again["decode_tokens_per_s"] == pytest.approx(decoded / again["decode_s"])


def test_the_decode_rate_counts_only_the_tokens_before_each_rows_stop():
  model = tiny_model(seed=23, head_dim=16)
  prompts = random_prompts(6, [21, 30], model.config.vocab_size)
  free = np.asarray(sj.generate(model, prompts, max_new_tokens=10, stop_tokens=()).tokens)
  stop = int(free[0, 3])                                         # row 0 stops at its 4th token at the latest
  out, stats = sj.generate(model, prompts, max_new_tokens=10, stop_tokens=(stop,), return_stats=True)
  num = np.asarray(out.num_tokens)
  assert num[0] <= 4
  run_s = stats["decode_s"] - stats["compile_s"]                   # at most the compile seconds inside decoding
  assert stats["decode_tokens_per_s"] >= (num.sum() - 2) / stats["decode_s"] * (1 - 1e-9)
  assert stats["decode_tokens_per_s"] * max(run_s, 0.0) <= num.sum() - 2 + 1e-6


def test_offloaded_stats_are_the_simulated_paths():
  """The offloaded runtime ends each step in the jitted loop's tail: the same speculation counts and the same
  method statistics (here exact_on_miss's share of fetches made on the critical path)."""
  model = tiny_model(seed=23, head_dim=16)
  prompts = random_prompts(9, [33, 26], model.config.vocab_size)
  got = {}
  for offload in (False, True):
    method = sj.cache_config("specache", exact_on_miss=True, offload=offload, **SMALL)
    out, stats = sj.generate(model, prompts, max_new_tokens=12, cache=method, stop_tokens=(), return_stats=True)
    got[offload] = (np.asarray(out.tokens), stats)
  np.testing.assert_array_equal(got[True][0], got[False][0])
  for key in ("exact_hit_rate", "sync_fetch_rate", "sync_fetch_rate_per_layer"):
    np.testing.assert_allclose(got[True][1][key], got[False][1][key], rtol=1e-6, err_msg=key)
  assert 0.0 < got[True][1]["sync_fetch_rate"] < 1.0
