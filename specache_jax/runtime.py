"""The offloaded SpeCache runtime: per-layer dispatch that overlaps the κ fetch with compute.

Step t, layer l (all calls return at once under JAX's asynchronous dispatch; nothing blocks the loop):
  1. take layer l's rows for κ_t, fetched during step t-1 (double buffer: `pending[l]` -> state.fetched_*)
  2. run the layer (the decoder's own per-layer functions: no layer math is written here)
  3. append the real row's 16-bit K/V to the host store
  4. issue the gather of κ_{t+1} rows on the host and their `jax.device_put` — before layer l+1 is dispatched,
     so the transfer runs while layers l+1.. of step t compute.
The non-speculative ablation picks κ_t from the real row's low-bit attention and fetches it before the layer's
attention (the fetch on the critical path).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import decode
from specache_jax.caches import specache as sc
from specache_jax.model import decoder as dec
from specache_jax.offload import make_store, plan_memory


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def _prefill_layer(lp, x, lengths, st, *, cfg, method):
  q, k, v = dec.attention_inputs(cfg, lp, x, lengths, "prefill")
  attn, st, _ = dec.cache_attention(cfg, method, st, q, k, v, lengths, "prefill")
  return dec.layer_output(cfg, lp, x, attn), st, k, v


@functools.partial(jax.jit, static_argnames=("cfg", "method", "phase"))
def _layer(lp, x, lengths, st, *, cfg, method, phase):
  return dec.layer_forward(cfg, method, lp, x, lengths, st, phase)


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def _nonspec_kappa(lp, x, lengths, st, *, cfg, method):
  q, k, v = dec.attention_inputs(cfg, lp, x, lengths, "decode")
  return sc.choose_nonspeculative(method, st, q, k, v, lengths)


@jax.jit
def _embed(params, tokens):
  return dec.embed(params, tokens)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head(params, x, rows, *, cfg):
  x = jnp.take_along_axis(x, rows[:, None, None], axis=1)
  return dec.lm_head(params, cfg, x)[:, 0]                                  # [B, V]


@functools.partial(jax.jit, static_argnames=("cfg", "greedy"))
def _head_all(params, x, rng, temperature, top_p, *, cfg, greedy):
  logits = dec.lm_head(params, cfg, x)                                      # [B, W, V]
  nxt = decode.sample(logits[:, 0], rng, temperature, top_p, greedy)
  spec = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
  return nxt, spec


@dataclasses.dataclass
class Timings:
  prefill_s: float = 0.0
  decode_s: float = 0.0
  steps: int = 0


class OffloadRuntime:
  """Generation with the 16-bit cache in host memory. One instance per (model, method, batch, max_len)."""

  def __init__(self, params, cfg, method, batch: int, max_len: int, prompt_len: int | None = None,
               device=None, check_memory: bool = True):
    if not getattr(method, "offload", False):
      raise ValueError(f"the offload runtime needs a SpeCache config with offload=True; got {method!r}")
    self.cfg, self.method, self.batch, self.max_len = cfg, method, batch, max_len
    self.device = device or jax.devices()[0]
    self.dtype = params["embed"].dtype
    self.plan = plan_memory(cfg, method, params, batch, max_len, self.dtype, prompt_len or max_len,
                            device=self.device)
    if check_memory:
      self.plan.check()
    self.params = params
    self.layer_params = [jax.tree.map(lambda a, l=l: a[l], params["layers"]) for l in range(cfg.n_layers)]
    self.store = None
    self.states = None
    self.timings = Timings()

  def _init(self):
    st = self.method.impl.init(self.method, self.cfg, self.batch, self.max_len, self.dtype)
    self.states = [jax.tree.map(lambda a, l=l: a[l], st) for l in range(self.cfg.n_layers)]
    if self.store is not None:
      self.store.close()
    self.store = make_store(self.method.host_store, self.cfg.n_layers, self.batch, self.cfg.n_kv_heads,
                            self.method.slots(self.max_len), self.cfg.head_dim, self.dtype, self.device)

  def device_bytes(self) -> int:
    return int(sum(sc.device_bytes(self.method, s) for s in self.states))

  def prefill(self, tokens_BT, lengths_B):
    self._init()
    kw = dict(cfg=self.cfg, method=self.method)
    x = _embed(self.params, tokens_BT)
    for l, lp in enumerate(self.layer_params):
      x, self.states[l], k, v = _prefill_layer(lp, x, lengths_B, self.states[l], **kw)
      self.store.write_prompt(l, k, v)
    return _head(self.params, x, lengths_B - 1, cfg=self.cfg)

  def predecode(self, first_B, lengths_B):
    """T1 over the low-bit copy; issues the fetch of κ_1 per layer right after that layer."""
    pending = []
    x = _embed(self.params, first_B[:, None])
    for l, lp in enumerate(self.layer_params):
      x, self.states[l], _ = _layer(lp, x, lengths_B, self.states[l], cfg=self.cfg, method=self.method,
                                    phase="predecode")
      pending.append(self.store.fetch(l, self.states[l].kappa))
    return x, pending

  def step(self, inp_BW, lengths_B, pending, miss_B=None):
    """One decoding step over all layers; returns (x [B, W, D], next pending fetches).

    miss_B (numpy bool [B], with exact_on_miss): rows whose speculative token was wrong get the real row's own
    top-k fetched synchronously instead of the prefetched rows."""
    x = _embed(self.params, inp_BW)
    nxt_pending = []
    exact = self.method.speculative and self.method.exact_on_miss and miss_B is not None and miss_B.any()
    for l, lp in enumerate(self.layer_params):
      st = self.states[l]
      if self.method.speculative:
        k_rows, v_rows = pending[l].result()
        st = st.replace(fetched_k=k_rows, fetched_v=v_rows)
        if exact:
          miss = jnp.asarray(miss_B)
          kappa = jnp.where(miss[:, None, None], _nonspec_kappa(lp, x[:, :1], lengths_B, st, cfg=self.cfg,
                                                                method=self.method), st.kappa)
          k_rows, v_rows = self.store.fetch(l, kappa).result()
          st = st.replace(kappa=kappa, fetched_k=k_rows, fetched_v=v_rows, miss=miss)
      else:
        kappa = _nonspec_kappa(lp, x, lengths_B, st, cfg=self.cfg, method=self.method)
        k_rows, v_rows = self.store.fetch(l, kappa).result()
        st = st.replace(kappa=kappa, fetched_k=k_rows, fetched_v=v_rows)
      x, st, _ = _layer(lp, x, lengths_B, st, cfg=self.cfg, method=self.method, phase="decode")
      self.states[l] = st
      self.store.append(l, st.new_k, st.new_v, lengths_B)
      if self.method.speculative:
        nxt_pending.append(self.store.fetch(l, st.kappa))                   # κ_{t+1}: overlaps layers l+1..
    return x, nxt_pending

  def generate(self, tokens_BT, lengths_B, max_new_tokens: int, rng, temperature=0.0, top_p=1.0,
               stop_tokens=(), pad_id=0) -> decode.GenerateOutput:
    greedy = temperature == 0.0
    temperature, top_p = jnp.float32(temperature), jnp.float32(top_p)
    lengths = jnp.asarray(lengths_B, jnp.int32)
    stops = np.asarray(stop_tokens, np.int64)
    t0 = time.perf_counter()
    logits = self.prefill(jnp.asarray(tokens_BT), lengths)
    rng, sub = jax.random.split(rng)
    first = decode.sample(logits, sub, temperature, top_p, greedy)
    if self.method.speculative:
      x, pending = self.predecode(first, lengths)
      spec = jnp.argmax(_head(self.params, x, jnp.zeros_like(lengths), cfg=self.cfg), axis=-1).astype(jnp.int32)
      inp = jnp.stack([first, spec], axis=1)
    else:
      pending, inp = None, first[:, None]
    jax.block_until_ready(inp)
    t1 = time.perf_counter()
    out = [np.asarray(first)]
    done = np.isin(out[0], stops)
    num = np.ones_like(out[0], dtype=np.int32)
    spec_hits = spec_steps = 0
    miss = None
    for _ in range(1, max_new_tokens):
      if done.all():
        break
      x, pending = self.step(inp, lengths, pending, miss)
      rng, sub = jax.random.split(rng)
      nxt, spec = _head_all(self.params, x, sub, temperature, top_p, cfg=self.cfg, greedy=greedy)
      nxt_np = np.where(done, pad_id, np.asarray(nxt))
      if self.method.speculative:
        miss = np.asarray(inp[:, 1]) != nxt_np
        spec_hits += int(np.sum(~miss & ~done))
        spec_steps += int(np.sum(~done))
      num += (~done).astype(np.int32)
      out.append(nxt_np)
      done = done | np.isin(nxt_np, stops)
      nxt = jnp.asarray(nxt_np)
      inp = jnp.stack([nxt, spec], axis=1) if self.method.speculative else nxt[:, None]
      lengths = lengths + 1
      self.timings.steps += 1
    jax.block_until_ready(self.states)
    t2 = time.perf_counter()
    self.timings.prefill_s, self.timings.decode_s = t1 - t0, t2 - t1
    tokens = np.full((self.batch, max_new_tokens), pad_id, np.int32)
    tokens[:, :len(out)] = np.stack(out, axis=1)
    stats = {"spec_token_hits": np.float32(spec_hits), "spec_token_steps": np.float32(spec_steps)}
    return decode.GenerateOutput(tokens=jnp.asarray(tokens), num_tokens=jnp.asarray(num), stats=stats)
