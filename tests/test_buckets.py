"""Shape buckets (specache_jax/buckets.py): a generate call whose prompt and generation lengths fall in a warm
bucket compiles nothing, for every method, and the padding does not change the tokens."""
import math

import numpy as np
import pytest

import specache_jax as sj
from specache_jax import buckets
from specache_jax.errors import ConfigError
from tests.tiny import random_prompts, tiny_model

SMALL = dict(bits=1, group_size=8, residual=8, topk=4)
METHODS = {
    "full": lambda: sj.cache_config("full"),
    "kivi": lambda: sj.cache_config("kivi", bits=2, group_size=8, residual=16),
    "specache": lambda: sj.cache_config("specache", **SMALL),
    "specache_offloaded": lambda: sj.cache_config("specache", offload=True, **SMALL),
    "robust": lambda: sj.cache_config("specache", preset="robust", **dict(SMALL, topk=8)),
    "robust_offloaded": lambda: sj.cache_config("specache", preset="robust", **dict(SMALL, topk=8), offload=True),
    "streaming": lambda: sj.cache_config("streaming", budget=24),
    "h2o": lambda: sj.cache_config("h2o", budget=24),
    "quest": lambda: sj.cache_config("quest", budget=16, page_size=4),
    "quest_offloaded": lambda: sj.cache_config("quest", budget=16, page_size=4, offload=True),
    "infllm": lambda: sj.cache_config("infllm", budget=20, n_init=4, block_size=4, repr_topk=2),
    "infllm_offloaded": lambda: sj.cache_config("infllm", budget=20, n_init=4, block_size=4, repr_topk=2,
                                                offload=True),
}


def _brute_force(n: int, ratios, floor: int = 16) -> int:
  sizes = {floor} | {-(-math.ceil(2 ** k * r) // 16) * 16 for k in range(14) for r in ratios}
  return min(s for s in sizes if s >= n and s >= floor)


def test_the_default_buckets_are_the_smallest_that_hold_the_length():
  policy = buckets.DEFAULT
  assert [policy.prompt(n) for n in (1, 16, 17, 33, 49, 65, 97, 1000, 1010, 1024, 1025, 1100, 1537)] == \
      [16, 16, 32, 48, 64, 80, 112, 1024, 1024, 1024, 1280, 1280, 1792]
  assert [policy.new_tokens(n) for n in (1, 9, 17, 32, 33, 40, 64, 65, 200)] == [64] * 7 + [128, 256]
  for n in range(1, 5000, 7):
    assert policy.prompt(n) == _brute_force(n, policy.prompt_ratios), n
    assert policy.new_tokens(n) == _brute_force(n, policy.new_token_ratios, 64), n
  assert buckets.BucketPolicy(floor=64, quantum=1).bucket(65, (1.0,)) == 128


def test_the_plan_cuts_the_prompt_to_its_longest_row_and_caps_the_buckets_at_the_context():
  shapes = buckets.plan(buckets.DEFAULT, 1000, 1000, 40, max_position=4096)
  assert (shapes.prompt_width, shapes.out_width, shapes.slot_tokens) == (1024, 64, 1088)
  wide = buckets.plan(buckets.DEFAULT, 4224, 1000, 40, max_position=8192)     # an array padded past its rows
  assert wide.prompt_width == 1024
  capped = buckets.plan(buckets.DEFAULT, 1000, 1000, 40, max_position=1050)
  assert (capped.prompt_width, capped.slot_tokens) == (1024, 1050)
  tight = buckets.plan(buckets.DEFAULT, 1000, 1000, 40, max_position=1020)
  assert (tight.prompt_width, tight.slot_tokens) == (1008, 1040)
  exact = buckets.plan(None, 1000, 990, 40, max_position=4096)
  assert (exact.prompt_width, exact.out_width, exact.slot_tokens) == (1008, 40, 1030)


@pytest.mark.parametrize("bad", [dict(floor=0), dict(quantum=0), dict(prompt_ratios=()),
                                 dict(new_token_ratios=(2.0,)),
                                 dict(new_token_floor=0)])
def test_a_bad_policy_names_its_value(bad):
  with pytest.raises(ConfigError, match=next(iter(bad))):
    buckets.BucketPolicy(**bad)


def test_generate_rejects_a_policy_of_the_wrong_type():
  model = tiny_model(seed=1)
  with pytest.raises(ConfigError, match="buckets="):
    sj.generate(model, [[1, 2, 3]], max_new_tokens=2, buckets=64)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_new_length_in_a_warm_bucket_compiles_nothing_and_keeps_the_tokens(name):
  model = tiny_model(seed=23, head_dim=16)
  vocab = model.config.vocab_size
  run = lambda prompts, new, **kw: sj.generate(model, prompts, max_new_tokens=new, cache=METHODS[name](),
                                               stop_tokens=(), return_stats=True, **kw)
  _, warm = run(random_prompts(5, [40, 29], vocab), 9)          # prompt width 48, output width 64
  assert warm["compilations"] > 0
  prompts = random_prompts(6, [45, 33], vocab)
  out, stats = run(prompts, 12)                                   # the same buckets
  assert stats["compilations"] == 0 and stats["compile_s"] == 0.0, stats
  assert out.tokens.shape == (2, 12)
  exact, _ = run(prompts, 12, buckets=None)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(exact.tokens))
  np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(exact.num_tokens))
