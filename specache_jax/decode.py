"""Generation: prefill, SpeCache's pre-decoding pass, one jitted `lax.while_loop` decode, sampling.

Every cache method runs through the same loop; a method that decodes two rows per step (SpeCache: the real
token and a speculative one) declares `decode_width = 2` and the loop feeds `[T_t, T'_{t+1}]`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax import guards
from specache_jax.caches.base import Cache, CacheConfig
from specache_jax.model.config import ModelConfig
from specache_jax.model.decoder import forward

SLOT_ROUNDING = 128  # cache slots are rounded up so nearby lengths reuse one compiled program


@struct.dataclass
class GenerateOutput:
  tokens: jax.Array        # [B, M] int32; after a stop token, the row repeats `pad_id`
  num_tokens: jax.Array    # [B] int32 tokens generated up to and including the first stop token
  stats: dict              # method statistics summed over steps and rows, leaves [L] (plus "steps", "spec_*")


def sample(logits_BV, rng, temperature, top_p, greedy: bool):
  """Greedy (argmax) or temperature + nucleus sampling with an explicit PRNG key -> [B] int32."""
  if greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits = logits_BV / jnp.maximum(temperature, 1e-6)
  order = jnp.argsort(-logits, axis=-1)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs                 # mass strictly before each candidate
  sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)   # the top candidate always stays
  choice = jax.random.categorical(rng, sorted_logits, axis=-1)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def init_cache(method: CacheConfig, cfg: ModelConfig, batch: int, max_len: int, dtype) -> Cache:
  layers = method.impl.init(method, cfg, batch, max_len, dtype)
  return Cache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))


def slots_for(method: CacheConfig, max_prompt: int, max_new_tokens: int) -> int:
  need = max_prompt + max_new_tokens + method.decode_width
  return -(-need // SLOT_ROUNDING) * SLOT_ROUNDING


def _masked_sum(aux, active_B):
  """aux leaves [L, B] -> [L] summed over the active rows."""
  w = active_B.astype(jnp.float32)
  return jax.tree.map(lambda a: jnp.einsum("lb,b->l", a.astype(jnp.float32), w), aux)


def observe_speculation(method: CacheConfig, cache: Cache, missed_B) -> Cache:
  """Tell a two-row method which rows' speculative token missed (its `observe_speculation` hook, if any)."""
  observe = getattr(method.impl, "observe_speculation", None)
  return cache if observe is None else cache.replace(layers=observe(method, cache.layers, missed_B))


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_new_tokens", "greedy", "stop_tokens",
                                             "max_len", "pad_id", "mesh", "check_numerics"))
def generate_jit(params, tokens_BT, lengths_B, rng, temperature, top_p, *, cfg: ModelConfig,
                 method: CacheConfig, max_new_tokens: int, greedy: bool, stop_tokens: tuple, max_len: int,
                 pad_id: int, mesh=None, check_numerics: bool = False):
  """mesh: a ("data", "model") Mesh to lay the cache out on (sharding.py; params arrive already sharded).
  check_numerics: carry guards' first-non-finite record, returned as stats[guards.RECORD_KEY]."""
  b = tokens_BT.shape[0]
  dtype = params["embed"].dtype
  cache = init_cache(method, cfg, b, max_len, dtype)
  if mesh is not None:
    from specache_jax.sharding import constrain_cache
    pin = lambda c: constrain_cache(c, mesh)
  else:
    pin = lambda c: c
  cache = pin(cache)
  record = guards.empty_record()
  stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)

  def is_stop(tok_B):
    return jnp.any(tok_B[:, None] == stops[None, :], axis=-1)

  logits, cache, _ = forward(params, cfg, tokens_BT, cache, method, "prefill", prompt_lengths=lengths_B,
                             logits_at=lengths_B - 1)
  cache = pin(cache)
  if check_numerics:
    record = guards.update(record, 0, "prefill", logits, cache.layers)
  rng, sub = jax.random.split(rng)
  first = sample(logits[:, 0], sub, temperature, top_p, greedy)
  if method.uses_predecode:
    logits_p, cache, _ = forward(params, cfg, first[:, None], cache, method, "predecode")
    cache = pin(cache)
    if check_numerics:
      record = guards.update(record, 1, "predecode", logits_p, cache.layers)
    inp = jnp.stack([first, jnp.argmax(logits_p[:, 0], axis=-1).astype(jnp.int32)], axis=1)
  else:
    inp = first[:, None]
  out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = is_stop(first)
  num = jnp.ones((b,), jnp.int32)

  step_shape = jax.eval_shape(lambda c, i: forward(params, cfg, i, c, method, "decode")[2], cache, inp)
  stats0 = jax.tree.map(lambda s: jnp.zeros(s.shape[:1], jnp.float32), step_shape)
  spec0 = jnp.zeros((), jnp.float32)

  def cond(carry):
    i, _, _, _, done, _, _, _, _, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, cache, inp, out, done, num, rng, stats, (spec_hits, spec_total), record = carry
    active = ~done
    logits, cache, aux = forward(params, cfg, inp, cache, method, "decode")
    cache = pin(cache)
    if check_numerics:
      record = guards.update(record, i, "decode", logits, cache.layers)
    rng, sub = jax.random.split(rng)
    nxt = sample(logits[:, 0], sub, temperature, top_p, greedy)
    nxt = jnp.where(done, pad_id, nxt)
    stats = jax.tree.map(jnp.add, stats, _masked_sum(aux, active))
    if method.decode_width == 2:
      spec_hits = spec_hits + jnp.sum((inp[:, 1] == nxt) & active)
      spec_total = spec_total + jnp.sum(active)
      cache = observe_speculation(method, cache, inp[:, 1] != nxt)
      inp = jnp.stack([nxt, jnp.argmax(logits[:, 1], axis=-1).astype(jnp.int32)], axis=1)
    else:
      inp = nxt[:, None]
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
    num = num + active.astype(jnp.int32)
    done = done | is_stop(nxt)
    return i + 1, cache, inp, out, done, num, rng, stats, (spec_hits, spec_total), record

  carry = (jnp.int32(1), cache, inp, out, done, num, rng, stats0, (spec0, spec0), record)
  _, cache, _, out, _, num, _, stats, (spec_hits, spec_total), record = jax.lax.while_loop(cond, body, carry)
  stats = dict(stats)
  stats["spec_token_hits"] = spec_hits
  stats["spec_token_steps"] = spec_total
  if check_numerics:
    stats[guards.RECORD_KEY] = record
  return GenerateOutput(tokens=out, num_tokens=num, stats=stats)


def summarize_stats(stats: dict[str, Any]) -> dict[str, float]:
  """Turn summed counters into rates: exact speculative-token hit rate and the mean top-k hit rate."""
  res = {}
  steps = float(stats.get("spec_token_steps", 0.0))
  if steps:
    res["exact_hit_rate"] = float(stats["spec_token_hits"]) / steps
  if "topk_hits" in stats and "topk_count" in stats:
    hits = jnp.asarray(stats["topk_hits"])
    count = jnp.asarray(stats["topk_count"])
    res["topk_hit_rate"] = float(jnp.sum(hits) / jnp.maximum(jnp.sum(count), 1.0))
    res["topk_hit_rate_per_layer"] = [float(x) for x in hits / jnp.maximum(count, 1.0)]
  return res
