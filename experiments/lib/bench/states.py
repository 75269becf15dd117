"""Prefilled cache states for every method from ONE pass of the model over a prompt.

A long prefill is the slow part of a decode benchmark (SmolLM2 at 8k tokens: ~45 s per row on this CPU), and
every method stores the same thing from it: each layer's post-RoPE K/V (and, for H2O, the attention each key
received). `capture` runs the decoder's own prefill with a cache method that keeps exactly that, once per
prompt; `build_cache` then applies any method's own `prefill` to it layer by layer — the same function on the
same inputs as the decoder's prefill, so the state is the one `forward(..., "prefill")` would have built.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax import decode, history
from specache_jax.arrays import tree_nbytes
from specache_jax.caches.base import Cache, CacheConfig, check_int, stack_layers
from specache_jax.errors import ConfigError
from specache_jax.model import decoder


@dataclasses.dataclass(frozen=True)
class CaptureConfig(CacheConfig):
  """A prefill-only pseudo cache method that keeps the prompt's K/V and attention column sums."""
  name = "capture"
  needs_attention_colsum = True
  width: int = 1                # T, the prompt width

  def __post_init__(self):
    check_int("width", self.width, 1)

  @property
  def impl(self):
    return sys.modules[__name__]


@struct.dataclass
class Captured:
  k: jax.Array        # [B, T, K, H] post-RoPE keys (leaves get a leading L)
  v: jax.Array        # [B, T, K, H]
  colsum: jax.Array   # [B, K, T] float32 attention each key received (H2O's prefill input)


def init(cfg: CaptureConfig, model_cfg, batch, max_len, dtype) -> Captured:
  del max_len
  kv = (batch, cfg.width, model_cfg.n_kv_heads, model_cfg.head_dim)
  return stack_layers(model_cfg.n_layers, Captured(
      k=jnp.zeros(kv, dtype), v=jnp.zeros(kv, dtype),
      colsum=jnp.zeros((batch, model_cfg.n_kv_heads, cfg.width), jnp.float32)))


def prefill(cfg, st: Captured, k, v, lengths, colsum=None) -> Captured:
  del cfg, lengths
  return Captured(k=k.astype(st.k.dtype), v=v.astype(st.v.dtype), colsum=colsum.astype(jnp.float32))


def attend(cfg, st, q, k_new, v_new, lengths):
  raise ConfigError("the capture method stores a prompt only; decode through a real cache method")


def device_bytes(cfg, st: Captured) -> int:
  return tree_nbytes(st)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _capture_jit(params, tokens_BT, lengths_B, *, cfg):
  b, t = tokens_BT.shape
  method = CaptureConfig(width=t)
  cache = decode.init_cache(method, cfg, b, t, params["embed"].dtype)
  logits, cache = decode.prefill(params, cfg, method, tokens_BT, lengths_B, cache)
  return decode.guess(logits), cache.layers


def capture(params, cfg, tokens_BT, lengths_B, rows_at_once: int = 1):
  """Prefill the prompts `rows_at_once` rows at a time (bounded memory, one compiled program).

  tokens [B, T] int32 right-padded, lengths [B]. Returns (first generated token [B] int32 (greedy),
  Captured with leaves [L, B, ...])."""
  check_int("rows_at_once", rows_at_once, 1)
  b = tokens_BT.shape[0]
  if b % rows_at_once:
    raise ValueError(f"{rows_at_once=} must divide the batch {b}")
  firsts, parts = [], []
  for i in range(0, b, rows_at_once):
    first, cap = _capture_jit(params, jnp.asarray(tokens_BT[i:i + rows_at_once]),
                              jnp.asarray(lengths_B[i:i + rows_at_once]), cfg=cfg)
    firsts.append(first)
    parts.append(cap)
  if len(parts) == 1:
    return firsts[0], parts[0]
  cat = lambda *xs: jnp.concatenate(xs, axis=1)                           # the B axis after L
  return jnp.concatenate(firsts), jax.tree.map(cat, *parts)


def take_rows(captured: Captured, first_B, batch: int):
  """The first `batch` rows of a capture (a smaller batch from the same prompts)."""
  return first_B[:batch], jax.tree.map(lambda x: x[:, :batch], captured)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_len", "repeat"))
def build_cache(captured: Captured, lengths_B, tokens_BT=None, *, cfg, method: CacheConfig,
                max_len: int, repeat: int = 1) -> Cache:
  """The method's prefilled cache (leaves [L, ...]) for prompts of `lengths` tokens in `max_len` slots.
  tokens_BT: the prompts' ids, which a method with `keeps_tokens` stores (`Cache.tokens`). repeat: each captured
  row stands for `repeat` consecutive rows of the batch, copied inside each layer's step (one layer's copies
  exist at a time); lengths_B and tokens_BT are the whole batch's."""
  b = lengths_B.shape[0]
  if b != captured.k.shape[1] * repeat:
    raise ValueError(f"lengths_B has {b} rows; the capture's {captured.k.shape[1]} rows x {repeat=} make "
                     f"{captured.k.shape[1] * repeat}")
  ids = None
  if method.speculation.keeps_tokens:
    if tokens_BT is None:
      raise ConfigError(f"{method.name} keeps the ids of its tokens (lookup guesses): build_cache needs the "
                        "prompts' tokens_BT")
    ids = history.write_prompt(history.empty(b, method.slots(max_len)), tokens_BT)
  dtype = captured.k.dtype
  st = method.impl.init(method, cfg, b, max_len, dtype)

  def one(args):
    st_l, k, v, colsum = (args[0], *(jnp.repeat(a, repeat, axis=0) for a in args[1:]))
    return method.impl.prefill(method, st_l, k, v, lengths_B, colsum if method.needs_attention_colsum else None)

  layers = jax.lax.map(one, (st, captured.k, captured.v, captured.colsum))
  return Cache(layers=layers, lengths=lengths_B.astype(jnp.int32), tokens=ids)


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def first_decode_input(params, first_B, cache: Cache, *, cfg, method: CacheConfig):
  """The decoding loop's first input (`decode.start`: SpeCache's pre-decoding pass fetches κ1) and the cache
  in the per-layer layout decoding steps update in place. Returns (inp [B, W] int32, cache)."""
  inp, cache, _ = decode.start(params, cfg, method, first_B, cache)
  return inp, decoder.per_layer(cache, cfg.n_layers)


def cell_slots(prompt_len: int, decode_steps: int) -> int:
  """One slot count for every method of a benchmark cell: enough for the widest method (2 rows per step),
  rounded like `sj.generate`. Budget-matched methods are sized at exactly this many slots."""
  return decode.slots_for(prompt_len + decode_steps, decode_width=2)
