"""The decoder: a pure function of params, tokens and an explicit cache pytree.

  logits, cache, aux = forward(params, cfg, tokens[B,T], cache, method, phase)

One per-layer function (`layer_forward`: norm -> q/k/v + RoPE -> attention through the cache method -> o_proj ->
norm -> SwiGLU) serves the jitted whole-model forward (a `lax.scan` over the stacked layers) and the offload
runtime (which calls it layer by layer). Phases:
  "prefill"   causal attention over the right-padded prompt in full precision; the method stores K/V.
  "decode"    the new rows attend through the method (`attend`), which stores what it keeps.
  "predecode" SpeCache's extra pass (`predecode`): attend to the low-bit cache, pick κ, store nothing.
Axis letters as in caches/attention.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specache_jax import cpu_kernels, history
from specache_jax.arrays import fusion_barrier
from specache_jax.caches import attention as A
from specache_jax.caches.base import Cache, CacheConfig
from specache_jax.dispatch import dense
from specache_jax.model.layers import apply_rope, rms_norm, rope_tables, swiglu_mlp
from specache_jax.model_config import ModelConfig

PHASES = ("prefill", "decode", "predecode")
ROW_CHUNK = 1024   # rows (batch x positions) per piece of a long prompt's per-row work (projections, MLP)


def positions_for(phase: str, lengths_B, t: int, offsets=None):
  """[B, T] positions of the new rows: a prompt starts at 0; decoding rows follow the stored tokens, at
  `offsets` from them (the method's `row_offsets`; default consecutive)."""
  offsets = jnp.asarray(tuple(range(t)) if offsets is None else offsets, jnp.int32)[None, :]
  if phase == "prefill":
    return jnp.broadcast_to(offsets, (lengths_B.shape[0], t))
  return lengths_B[:, None].astype(jnp.int32) + offsets


def rope_for(cfg: ModelConfig, phase: str, lengths_B, t: int, offsets=None):
  """RoPE tables (cos, sin) [B, T, 1, H] of the new rows, computed once per forward and shared by the layers.

  Behind a `fusion_barrier`: otherwise XLA:CPU fuses cos/sin into every consumer of a rotated query and
  recomputed them per element of the low-bit scores' [B, K, M, P, H] query·scale product (measured: SpeCache
  1-bit at 8k spent ~0.5 ms per layer there, ~16 ms of an ~80 ms step)."""
  return fusion_barrier(rope_tables(positions_for(phase, lengths_B, t, offsets), cfg), jnp.all(lengths_B >= 0))


def row_offsets(method: CacheConfig | None, phase: str, t: int):
  """The new rows' position offsets for `rope_for`: the method's in decoding and pre-decoding, else consecutive."""
  return None if method is None or phase == "prefill" else method.speculation.row_offsets(t)


def qkv(cfg: ModelConfig, lp, h_BTD, rope):
  """Projections + RoPE: q [B,T,N,H], k [B,T,K,H], v [B,T,K,H]."""
  b, t, _ = h_BTD.shape
  q, k, v = dense(h_BTD, lp["wq"], lp["wk"], lp["wv"])
  if cfg.qkv_bias:
    q = q + lp["bq"][None, None, :]
    k = k + lp["bk"][None, None, :]
    v = v + lp["bv"][None, None, :]
  q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
  k = k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  v = v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  return apply_rope(q, rope), apply_rope(k, rope), v


def attention_inputs(cfg: ModelConfig, lp, x_BTD, rope):
  """Pre-attention half of a layer: RMSNorm, projections, RoPE (`rope_for`) -> q [B,T,N,H], k, v [B,T,K,H].
  Runs `in_row_chunks`."""
  def rows(x, cos, sin):
    return qkv(cfg, lp, rms_norm(x, lp["attn_norm"], cfg.norm_eps), (cos, sin))
  return in_row_chunks(rows, x_BTD, *rope)


def layer_output(cfg: ModelConfig, lp, x_BTD, attn_BTNH):
  """Post-attention half of a layer: o_proj + residual, RMSNorm, SwiGLU + residual -> x [B,T,D].
  Runs `in_row_chunks`."""
  def rows(x, attn):
    b, t, _ = x.shape
    x = x + dense(attn.reshape(b, t, -1), lp["wo"])
    return x + swiglu_mlp(rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp)
  return in_row_chunks(rows, x_BTD, attn_BTNH)


def in_row_chunks(fn, *arrays_BT, chunk: int | None = None):
  """fn over arrays [B, T, ...] applied to pieces of `chunk` rows of the flattened B·T axis (a `lax.map`, plus
  one piece for the remainder) -> fn's outputs [B, T, ...]. fn must treat rows independently.

  A long prompt's projections and MLP run as GEMMs whose [rows, F] intermediates stay in cache (measured at
  T=8192 on the 2-core CPU: the SwiGLU MLP 315 ms whole vs 235 ms in pieces of 512-1024 rows)."""
  chunk = ROW_CHUNK if chunk is None else chunk
  b, t = arrays_BT[0].shape[:2]
  n = b * t
  if n <= chunk:
    return fn(*arrays_BT)
  flat = [a.reshape((n,) + a.shape[2:]) for a in arrays_BT]
  n_full, tail = divmod(n, chunk)
  call = lambda xs: fn(*[x[None] for x in xs])                          # a piece as [1, rows, ...]
  pieces = jax.lax.map(lambda xs: jax.tree.map(lambda y: y[0], call(xs)),
                       [x[:n_full * chunk].reshape((n_full, chunk) + x.shape[1:]) for x in flat])
  pieces = jax.tree.map(lambda y: y.reshape((n_full * chunk,) + y.shape[2:]), pieces)
  if tail:
    rest = jax.tree.map(lambda y: y[0], call([x[n_full * chunk:] for x in flat]))
    pieces = jax.tree.map(lambda a, r: jnp.concatenate([a, r], axis=0), pieces, rest)
  return jax.tree.map(lambda y: y.reshape((b, t) + y.shape[1:]), pieces)


def cache_attention(cfg: ModelConfig, method: CacheConfig | None, st, q, k, v, lengths_B, phase: str):
  """Attention through the cache method for one layer -> (attn [B,T,N,H], new state, aux)."""
  aux = {}
  if phase == "prefill":
    want_colsum = method is not None and method.needs_attention_colsum
    attn, colsum = A.prefill_attention(q, k, v, lengths_B, cfg.head_dim ** -0.5, want_colsum)
    if method is not None:
      st = method.impl.prefill(method, st, k, v, lengths_B, colsum)
  elif phase == "decode":
    attn, st, aux = method.impl.attend(method, st, q, k, v, lengths_B)
  elif phase == "predecode":
    attn, st, aux = method.impl.predecode(method, st, q, k, v, lengths_B)
  else:
    raise ValueError(f"phase={phase!r} must be one of {PHASES}")
  return attn, st, aux


def layer_forward(cfg: ModelConfig, method: CacheConfig | None, lp, x_BTD, lengths_B, st, phase: str, rope):
  """One decoder layer. lengths: the prompt lengths (prefill) or tokens already stored (decode/predecode);
  rope: `rope_for(cfg, phase, lengths, T, row_offsets(method, phase, T))`.

  Returns (x [B,T,D], new per-layer state, aux dict)."""
  q, k, v = attention_inputs(cfg, lp, x_BTD, rope)
  attn, st, aux = cache_attention(cfg, method, st, q, k, v, lengths_B, phase)
  return layer_output(cfg, lp, x_BTD, attn), st, aux


@functools.partial(jax.jit, static_argnames=("cfg", "method", "phase", "kernels"))
def layer_call(cfg: ModelConfig, method: CacheConfig | None, lp, x_BTD, lengths_B, st, phase: str, rope,
               kernels: bool):
  """`layer_forward` as one program: the per-layer loop calls it once per layer, so JAX traces and lowers one
  layer (the step's StableHLO holds one layer function called L times) however deep the model; XLA inlines the
  calls, so buffer aliasing and the in-place updates are those of the unrolled loop. kernels:
  `cpu_kernels.available()` at the call, a key of the trace cache (a trace made with the XLA:CPU kernels off,
  `cpu_kernels.disabled()`, is not the one made with them on)."""
  del kernels
  return layer_forward(cfg, method, lp, x_BTD, lengths_B, st, phase, rope)


def embed(params, tokens_BT):
  return jnp.take(params["embed"], tokens_BT, axis=0)


def lm_head(params, cfg: ModelConfig, x_BTD):
  """Final norm + LM head -> float32 logits [B, T, V]."""
  h = rms_norm(x_BTD, params["final_norm"], cfg.norm_eps)
  if cfg.tie_embeddings:
    return dense(h, params["embed"], transposed=True).astype(jnp.float32)
  return dense(h, params["lm_head"]).astype(jnp.float32)


def is_per_layer(layers) -> bool:
  """A per-layer layout (a tuple/list with one entry per layer) rather than one tree with leaves [L, ...]."""
  return isinstance(layers, (tuple, list))


def unstack_layers(layers, n_layers: int) -> tuple:
  """Leaves [L, ...] -> a tuple of L per-layer trees (a per-layer layout passes through unchanged)."""
  if is_per_layer(layers):
    return tuple(layers)
  return tuple(jax.tree.map(lambda a, l=l: a[l], layers) for l in range(n_layers))


def stack_layer_trees(layers):
  """A tuple of per-layer trees -> one tree with leaves [L, ...] (a stacked tree passes through unchanged)."""
  if not is_per_layer(layers):
    return layers
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def unstack_params(params, n_layers: int) -> dict:
  """Params whose "layers" is a tuple of per-layer dicts: what a decode step reads without slicing copies."""
  return dict(params, layers=unstack_layers(params["layers"], n_layers))


def per_layer(cache: Cache, n_layers: int) -> Cache:
  """The cache with one state per layer (the layout decode steps update in place)."""
  return cache.replace(layers=unstack_layers(cache.layers, n_layers))


def stacked(cache: Cache) -> Cache:
  """The cache with leaves [L, ...] (the layout a prefill scan writes and tests inspect)."""
  return cache.replace(layers=stack_layer_trees(cache.layers))


def forward(params, cfg: ModelConfig, tokens_BT, cache: Cache | None, method: CacheConfig | None,
            phase: str = "decode", prompt_lengths=None, logits_at=None):
  """The whole model over the layers.

  tokens [B, T] int32. prefill: `prompt_lengths` [B] (valid tokens per right-padded row; default T), the cache
  (if any) must be empty. decode/predecode: new rows follow `cache.lengths`.
  logits_at: None for logits at every row, or [B] row indices -> logits [B, 1, V] (saves the [B,T,V] head on
  long prompts). Returns (logits float32, cache, aux with leaves [L, ...]).

  Two layer loops, picked by the cache's layout (the same per-layer function in both):
    stacked cache (leaves [L, ...]) or no cache: a `lax.scan` over the layers — one compiled layer, compile
      time flat in depth, but every layer's weights and state are sliced out and the new state stacked back
      (copies). Right for a prefill, which is compute-bound and runs once.
    per-layer cache (a tuple, `per_layer`): a Python loop over the layers — each layer's state is its own
      buffer, updated in place when the caller donates it or carries it in a loop; with per-layer params
      (`unstack_params`) no weight is copied either. Right for decoding steps, which are bandwidth-bound.
  """
  b, t = tokens_BT.shape
  if phase == "prefill":
    lengths = (jnp.full((b,), t, jnp.int32) if prompt_lengths is None
               else jnp.asarray(prompt_lengths, jnp.int32))
  else:
    lengths = cache.lengths
  x = embed(params, tokens_BT)
  rope = rope_for(cfg, phase, lengths, t, row_offsets(method, phase, t))

  if cache is not None and is_per_layer(cache.layers):
    lps = unstack_layers(params["layers"], cfg.n_layers)
    kernels = cpu_kernels.available()
    new_states, auxes = [], []
    for lp, st in zip(lps, cache.layers):
      x, st, aux = layer_call(cfg, method, lp, x, lengths, st, phase, rope, kernels=kernels)
      new_states.append(st)
      auxes.append(aux)
    new_states = tuple(new_states)
    aux = jax.tree.map(lambda *xs: jnp.stack(xs), *auxes) if auxes and auxes[0] else {}
  else:
    def body(x, layer):
      lp, st = layer
      x, st, aux = layer_forward(cfg, method, lp, x, lengths, st, phase, rope)
      return x, (st, aux)

    layer_states = None if cache is None else cache.layers
    x, (new_states, aux) = jax.lax.scan(body, x, (stack_layer_trees(params["layers"]), layer_states))
  if logits_at is not None:
    x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)
  logits = lm_head(params, cfg, x)
  if cache is None:
    return logits, None, aux
  ids = cache.tokens
  if phase == "prefill":
    new_lengths = lengths
    ids = None if ids is None else history.write_prompt(ids, tokens_BT)
  elif phase == "decode":
    new_lengths = cache.lengths + method.speculation.rows_stored(t, phase)
    ids = None if ids is None else history.write_rows(ids, tokens_BT[:, :method.speculation.rows_stored(t, phase)],
                                                      cache.lengths)
  else:
    new_lengths = cache.lengths
  return logits, Cache(layers=new_states, lengths=new_lengths, tokens=ids), aux


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_full(params, cfg: ModelConfig, tokens_BT, lengths=None):
  """Cache-free causal forward: float32 logits [B, T, V] (rows past a row's length are padding)."""
  logits, _, _ = forward(params, cfg, tokens_BT, None, None, "prefill", prompt_lengths=lengths)
  return logits


forward_jit = jax.jit(forward, static_argnames=("cfg", "method", "phase"))
"""`forward` compiled once per (cfg, method, phase, shapes): what tests and step-by-step callers use."""
