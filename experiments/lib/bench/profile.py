"""Where a simulated SpeCache decode step spends its time (jnp path), next to the full cache's step.

Each piece of the per-layer `specache.attend` is jitted alone and timed on layer 0's real prefilled state,
then multiplied by the layer count (an estimate: XLA fuses across pieces inside the real step). Pieces:
  dequantize   the whole low-bit copy -> float32 keys and values [B, K, S, H] (jnp reference path)
  ring         the residual ring's columns (a gather + dequantized keys below the key boundary)
  attention    the segmented softmax over low-bit + ring + fetched + new columns (given dequantized K/V)
  scatter      the two scatters: κ columns excluded from the low-bit mask, the extra columns' probabilities
               added back per position ([B, K, S] each)
  top_k        κ_{t+1} = top-k of the speculative row's probabilities over S positions
  store_lowbit the real row's quantized append (values; keys when the residual window flushes) + the ring
  store_16bit  the real row written into the simulated host cache (alone, without donation, this includes a
               copy of the layer's [B, K, S, H] K and V; inside the step it is an in-place update)
  fetch        the simulated transfer: gather of the κ rows from the 16-bit cache
  scan_copy    the decoder's `lax.scan` over layers reads every layer's state and writes a new stacked state:
               the cost of passing the whole state through once (same for every method, per byte)
Axis letters as in caches/attention.py.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from experiments.lib.bench import states, timing
from experiments.lib.bench.common import random_prompts
from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches import cache_config, lowbit
from specache_jax.caches import selection
from experiments.lib.bench.throughput import decode_step_jit, unstack_params_jit


def time_decode_step(layer_params, cfg, method, cache, inp, warmup: int, iters: int):
  """Median seconds of one decoding-loop step (`decode_step_jit`: the per-layer cache donated, input and cache
  threaded; first call = compile + run, reported apart) -> (stats, the cache after the last step)."""
  holder = {"inp": inp, "cache": cache}

  def call():
    holder["inp"], holder["cache"] = decode_step_jit(layer_params, holder["inp"], holder["cache"], cfg=cfg,
                                                     method=method)
    return holder["inp"], holder["cache"]

  first_s, _ = timing.timed(call)
  stats = timing.time_calls(call, max(warmup - 1, 0), iters)
  stats["first_call_s"] = first_s
  return stats, holder["cache"]


def _stacked(layers):
  """A cache's layers as one state with leaves [L, ...] (decoding keeps a tuple of per-layer states)."""
  if isinstance(layers, (tuple, list)):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return layers


def _layer0(layers):
  return layers[0] if isinstance(layers, (tuple, list)) else jax.tree.map(lambda x: x[0], layers)


@functools.partial(jax.jit, static_argnames=("method",))
def _dequantize(st, *, method):
  return lowbit.dequantized(st.low, bits=method.bits, group_size=method.group_size)


@functools.partial(jax.jit, static_argnames=("method",))
def _ring(st, lengths, *, method):
  return lowbit.ring_segment(st.low, lengths, bits=method.bits, group_size=method.group_size,
                             residual=method.residual)


@functools.partial(jax.jit, static_argnames=("n_kv",))
def _attention(q, keys, values, low_mask, ring, fetched, new, *, n_kv):
  segs = [(keys, values, low_mask), ring, fetched, new]
  return A.segmented_attention(q, segs, q.shape[-1] ** -0.5, n_kv)


@jax.jit
def _scatter(kappa_BKX, probs_BKS, extra_idx_BKE, extra_p_BKE):
  s = probs_BKS.shape[-1]
  b, k = kappa_BKX.shape[:2]
  excluded = jnp.zeros((b, k, s + 1), bool)
  excluded = jax.vmap(jax.vmap(lambda e, i: e.at[i].set(True)))(excluded, kappa_BKX)
  probs = jnp.concatenate([probs_BKS, jnp.zeros((b, k, 1), jnp.float32)], -1)
  probs = jax.vmap(jax.vmap(lambda p, i, v: p.at[i].add(v)))(probs, extra_idx_BKE, extra_p_BKE)
  return excluded, probs


@functools.partial(jax.jit, static_argnames=("method",))
def _top_k(probs_BKS, lengths, *, method):
  return selection.select(method, probs_BKS, lengths + 1)


@functools.partial(jax.jit, static_argnames=("method",))
def _store_lowbit(low, k_BKH, v_BKH, lengths, *, method):
  return lowbit.append(low, k_BKH, v_BKH, lengths, **method.qargs)


@jax.jit
def _store_16bit(k16_BKSH, v16_BKSH, k_BKH, v_BKH, lengths):
  return A.write_rows(k16_BKSH, k_BKH[:, :, None], lengths), A.write_rows(v16_BKSH, v_BKH[:, :, None], lengths)


@jax.jit
def _fetch(k16_BKSH, v16_BKSH, kappa_BKX):
  return A.gather_rows(k16_BKSH, kappa_BKX), A.gather_rows(v16_BKSH, kappa_BKX)


@functools.partial(jax.jit, static_argnames=("method",))
def _attend(st, q, k, v, lengths, *, method):
  return method.impl.attend(method, st, q, k, v, lengths)


@jax.jit
def _scan_copy(layers):
  return jax.lax.scan(lambda c, st: (c + 1, st), jnp.int32(0), layers)[1]


def profile_specache_step(model, method, context: int, margin: int, seed: int, iters: int,
                          captured=None, batch: int = 1) -> dict:
  """Per-piece seconds (per layer and × L) of a SpeCache step at `context` slots, and the same run's
  whole-step times of SpeCache and full. `captured`: (first [B], Captured, lengths [B]) to reuse (its B wins
  over `batch`); else `batch` random prompts are prefilled."""
  cfg, params = model.config, model.params
  prompt_len = context - margin
  if captured is None:
    tokens, lens = random_prompts(seed + context, batch, prompt_len, cfg.vocab_size)
    first, cap = states.capture(params, cfg, tokens, lens)
    lengths = jnp.asarray(lens)
  else:
    first, cap, lengths = captured
  full = cache_config("full")
  layer_params = unstack_params_jit(params, cfg.n_layers)
  out = {"context": context, "batch": int(lengths.shape[0]), "method": repr(method), "pieces": {}}
  caches = {}
  for name, m in (("specache", method), ("full", full)):
    max_len = states.cell_slots(prompt_len, iters + 2)
    cache = states.build_cache(cap, lengths, cfg=cfg, method=m, max_len=max_len)
    inp, cache = states.first_decode_input(params, first, cache, cfg=cfg, method=m)
    stats, cache = time_decode_step(layer_params, cfg, m, cache, inp, 2, iters)
    caches[name] = cache
    out[f"step_{name}_s"] = stats["median_s"]
    stacked = _stacked(cache.layers)
    out[f"scan_copy_{name}_s"] = timing.time_calls(lambda: _scan_copy(stacked), 1, iters)["median_s"]
    out[f"state_bytes_{name}"] = tree_nbytes(cache.layers)
  st = _layer0(caches["specache"].layers)
  full_st = _layer0(caches["full"].layers)
  b, k, s, h = st.k16.shape
  n = cfg.n_heads
  t = method.speculation.width
  rng = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(rng[0], (b, t, n, h), jnp.float32).astype(st.k16.dtype)
  kn = jax.random.normal(rng[1], (b, t, k, h), jnp.float32).astype(st.k16.dtype)
  vn = jax.random.normal(rng[2], (b, t, k, h), jnp.float32).astype(st.k16.dtype)
  keys, values = _dequantize(st, method=method)
  ring_k, ring_v, ring_pos = _ring(st, lengths, method=method)
  x = method.topk
  mask = lambda cols: jnp.ones((b, k, t, cols), bool)
  probs = jax.nn.softmax(jax.random.normal(rng[0], (b, k, s), jnp.float32), axis=-1)
  extra_idx = jnp.concatenate([ring_pos, st.kappa, jnp.broadcast_to(lengths[:, None, None], (b, k, t))], -1)
  extra_p = jnp.ones(extra_idx.shape, jnp.float32)
  kn_BKTH, vn_BKTH = jnp.swapaxes(kn, 1, 2), jnp.swapaxes(vn, 1, 2)
  pieces = {
      "dequantize": lambda: _dequantize(st, method=method),
      "ring": lambda: _ring(st, lengths, method=method),
      "attention": lambda: _attention(q, keys, values, mask(s), (ring_k, ring_v, mask(method.residual)),
                                      (st.fetched_k, st.fetched_v, mask(x)), (kn_BKTH, vn_BKTH, mask(t)),
                                      n_kv=k),
      "scatter": lambda: _scatter(st.kappa, probs, extra_idx, extra_p),
      "top_k": lambda: _top_k(probs, lengths, method=method),
      "store_lowbit": lambda: _store_lowbit(st.low, kn_BKTH[:, :, 0], vn_BKTH[:, :, 0], lengths, method=method),
      "store_16bit": lambda: _store_16bit(st.k16, st.v16, kn_BKTH[:, :, 0], vn_BKTH[:, :, 0], lengths),
      "fetch": lambda: _fetch(st.k16, st.v16, st.kappa),
      "attend_specache_layer": lambda: _attend(st, q, kn, vn, lengths, method=method),
      "attend_full_layer": lambda: _attend(full_st, q[:, :1], kn[:, :1], vn[:, :1], lengths, method=full),
  }
  for name, fn in pieces.items():
    sec = timing.time_calls(fn, 1, iters)["median_s"]
    out["pieces"][name] = {"per_layer_s": sec, "x_layers_s": sec * cfg.n_layers}
  out["note"] = ("pieces are jitted alone on layer 0 and scaled by L (an estimate; the real step fuses them); "
                 "scan_copy is the whole stacked state passed through the layer scan once")
  return out
