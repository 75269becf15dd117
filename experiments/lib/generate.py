"""One prompt -> one completion, with any cache method (the body of experiments/generate.py)."""
from __future__ import annotations

import ast
import dataclasses
import time
from typing import Any

from experiments.lib import models
import specache_jax as sj


class SettingsError(ValueError):
  """config.cache_settings cannot be parsed."""


@dataclasses.dataclass
class Completion:
  text: str
  prompt_tokens: int
  new_tokens: int
  seconds: float
  stats: dict | None


def parse_settings(text: str) -> dict[str, Any]:
  """'bits=1,topk=64,offload=True' -> {'bits': 1, 'topk': 64, 'offload': True} (Python literals or bare words)."""
  out: dict[str, Any] = {}
  for item in [s.strip() for s in (text or "").split(",") if s.strip()]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip().isidentifier():
      raise SettingsError(f"cache_settings item {item!r} must look like name=value (e.g. 'bits=1,topk=64')")
    try:
      out[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[key.strip()] = value.strip()              # a bare word, e.g. attention_impl=jnp
  return out


def run(config, model=None, mesh=None) -> Completion:
  method = sj.cache_config(config.cache, **parse_settings(config.cache_settings))
  model = model or models.load(config.model, config.dtype)
  tok = model.tokenizer
  ids = models.chat_ids(tok, config.prompt) if config.chat else list(tok.encode(config.prompt))
  stops = models.stop_ids(model)
  t0 = time.time()
  toks, nums, stats = models.generate_rows(model, [ids], max_new_tokens=config.max_new_tokens,
                                           temperature=config.temperature, top_p=config.top_p, seed=config.seed,
                                           cache=method, stop_tokens=stops, return_stats=config.stats, mesh=mesh)
  num = int(nums[0])
  text = models.decode_answer(tok, toks[0], num, stops)
  return Completion(text, len(ids), num, time.time() - t0, stats)
