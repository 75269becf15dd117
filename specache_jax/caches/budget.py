"""Size a budget-sized baseline (the eviction methods StreamingLLM and H2O, the retrieval methods Quest and
InfLLM) to the device bytes of another method (e.g. SpeCache).

Bytes are read from the state's shapes (`jax.eval_shape` of `init`, nothing allocated) through each method's
own `device_bytes` (SpeCache's, Quest's and InfLLM's leave out their 16-bit host arrays k16/v16; the eviction
methods count everything: k, v and their per-slot bookkeeping pos (and H2O's score)). A budget moves in steps of
one slot, or one page for Quest (its budget is whole pages). InfLLM's bytes are affine in the budget only between
the budgets where one more block is retrieved (the window then shrinks by a block, and its scores with it): its
budget is found from the affine estimate by steps of one.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from specache_jax.arrays import tree_nbytes
from specache_jax.caches import cache_config
from specache_jax.caches.base import CacheConfig
from specache_jax.errors import ConfigError
from specache_jax.model_config import ModelConfig

EVICTION_METHODS = ("streaming", "h2o")
SIZED_METHODS = EVICTION_METHODS + ("quest", "infllm")


@dataclasses.dataclass(frozen=True)
class _Sized:
  """A stand-in leaf with an array's shape, dtype and nbytes (what `device_bytes` reads), no buffer."""
  shape: tuple
  dtype: np.dtype

  @property
  def nbytes(self) -> int:
    return tree_nbytes(self)


class BudgetBelowSmallest(ConfigError):
  """The reference's device bytes are fewer than the method's smallest budget takes: no matched setting exists
  at this length (a sweep may skip the cell and say so)."""


def device_bytes_at(method: CacheConfig, model_cfg: ModelConfig, max_len: int, dtype, batch: int = 1) -> int:
  """The method's accelerator bytes for `batch` rows of `max_len` tokens, from eval_shape (no allocation); with
  `speculation.keeps_tokens`, the cache's int32 token ids (`Cache.tokens`) too."""
  shapes = jax.eval_shape(lambda: method.impl.init(method, model_cfg, batch, max_len, dtype))
  sized = jax.tree.map(lambda s: _Sized(tuple(s.shape), np.dtype(s.dtype)), shapes)
  ids = 4 * batch * method.slots(max_len) if method.speculation.keeps_tokens else 0
  return method.device_bytes(sized) + ids


def _budget_step(method_name: str, settings: dict) -> int:
  """The budget's granularity: one slot, or one page (Quest)."""
  return settings.get("page_size", 16) if method_name == "quest" else 1


def _smallest_budget(method_name: str, settings: dict) -> int:
  if method_name == "streaming":
    return settings.get("sink", 4) + 1
  if method_name == "quest":
    return _budget_step(method_name, settings)
  if method_name == "infllm":
    return settings.get("n_init", 128) + max(settings.get("block_size", 128), settings.get("local") or 0)
  recent = settings.get("recent")
  return 1 if recent is None else recent


def _settle(bytes_for, target: int, budget: int, lo: int, steps: int = 4096) -> int:
  """From an estimate, the budget whose bytes are <= target while one more's are not (steps of one)."""
  for _ in range(steps):
    if budget > lo and bytes_for(budget) > target:
      budget -= 1
    elif bytes_for(budget + 1) <= target:
      budget += 1
    else:
      return budget
  raise AssertionError(f"no budget near {budget} settles at {target} device bytes in {steps} steps")


def matched_budget(method_name: str, reference: CacheConfig, model_cfg: ModelConfig, max_len: int, dtype,
                   **settings) -> CacheConfig:
  """The `method_name` config (other settings as given) with the largest budget whose device bytes at
  `max_len` (batch 1) do not exceed `reference`'s (the target): bytes <= target < bytes with one step more
  (a slot; a page for Quest). Quest's budget stops at the whole cache (`max_len` rounded to pages: every
  position attended), whatever bytes are left."""
  if method_name not in SIZED_METHODS:
    raise ConfigError(f"method_name={method_name!r} must be one of {SIZED_METHODS} (a budget-sized method)")
  if "budget" in settings:
    raise ConfigError(f"budget={settings['budget']!r} is what matched_budget computes; do not pass it")
  target = device_bytes_at(reference, model_cfg, max_len, dtype)

  def bytes_for(budget: int) -> int:
    return device_bytes_at(cache_config(method_name, budget=budget, **settings), model_cfg, max_len, dtype)

  lo, step = _smallest_budget(method_name, settings), _budget_step(method_name, settings)
  if method_name == "quest":            # the whole cache: every position attended, no budget above it
    whole = cache_config(method_name, budget=lo, **settings).slots(max_len)
    if bytes_for(whole) <= target:
      return cache_config(method_name, budget=whole, **settings)
  base, per_step = bytes_for(lo), bytes_for(lo + step) - bytes_for(lo)   # bytes are affine in the budget
  if base > target:
    raise BudgetBelowSmallest(f"{reference.name} uses {target} device bytes at max_len={max_len}, less than "
                      f"{method_name} with its smallest budget={lo} ({base} bytes)")
  budget = lo + (target - base) // per_step * step
  if method_name == "infllm":
    budget = _settle(bytes_for, target, budget, lo)
  method = cache_config(method_name, budget=budget, **settings)
  got, above = device_bytes_at(method, model_cfg, max_len, dtype), bytes_for(budget + step)
  if not got <= target < above:
    raise AssertionError(f"matched budget={budget} gives {got} bytes for a target of {target} ({above} with "
                         f"budget={budget + step}): the bytes are not affine in the budget")
  return method
