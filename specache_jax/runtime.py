"""The offloaded SpeCache runtime: dispatch in layer groups that overlaps the κ fetch with compute.

The layers run in a few consecutive groups (`layer_groups`; 5 calls per step by default), one jitted call per
group: each call is a Python dispatch, and on a 2-core CPU or in front of a GPU the dispatching thread's time is
not free. Step t, group g (all calls return at once under JAX's asynchronous dispatch; nothing blocks the loop):
  1. κ_t: take group g's rows fetched during step t-1 (double buffer: `pending[g]`), or — non-speculative,
     or exact_on_miss after a wrong guess
     — choose each layer's κ_t from the real row now (`specache.kappa_for_step`) and fetch it synchronously,
     layer by layer (the fetch on the critical path);
  2. run the group's layers (the decoder's own per-layer function; SpeCache's `attend` with offload=True attends
     with the fetched rows, stores the real row on the device side and records κ_{t+1}); their states are
     donated (updated in place) — only after `pending[g]` is waited on, so the worker has read their κ;
  3. when a row's residual ring has just filled (every R steps), write its R 16-bit rows to the host store
     at once (the host only ever serves κ rows below the ring's 16-bit keys: exactly the flushed rows);
  4. issue the gather of the group's κ_{t+1} rows on the host and their `jax.device_put` (one block per group)
     — before group g+1 is dispatched, so the transfer runs while groups g+1.. of step t compute; it is
     needed only by group g of step t+1.
The SpeCache step itself is written once, in caches/specache.py; here only the fetches differ (host store
instead of a device gather), and every write of the method's state goes through its functions.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specache_jax import decode, guards, history, offload, sharding
from specache_jax.caches import specache as sc
from specache_jax.caches.speculation import observe as observe_speculation
from specache_jax.model import decoder as dec


def _keep(st, layout):
  """On a mesh, pin a layer's state to its (data, model) layout (per-row writes would let B go replicated)."""
  return st if layout is None else jax.lax.with_sharding_constraint(st, layout)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "layout"), donate_argnames=("st",))
def _prefill_layer(lp, x, lengths, rope, st, row0=None, *, cfg, method, layout=None):
  """One layer's prefill of every sequence, or (row0: an int32 scalar) of the x.shape[0] sequences from row0
  on, written into those rows of the whole batch's state."""
  q, k, v = dec.attention_inputs(cfg, lp, x, rope)
  part = st if row0 is None else jax.tree.map(                       # every leaf is [B, ...]
      lambda a: jax.lax.dynamic_slice_in_dim(a, row0, x.shape[0], 0), st)
  attn, part, _ = dec.cache_attention(cfg, method, part, q, k, v, lengths, "prefill")
  st = part if row0 is None else jax.tree.map(
      lambda a, p: jax.lax.dynamic_update_slice_in_dim(a, p, row0, 0), st, part)
  return dec.layer_output(cfg, lp, x, attn), _keep(st, layout), k, v


DISPATCH_GROUPS = 5       # jitted calls per decoding step (OffloadRuntime's default)


def layer_groups(n_layers: int, groups: int) -> tuple[tuple[int, ...], ...]:
  """Layers 0..n_layers-1 as `groups` runs of consecutive layers (fewer when there are fewer layers), sizes
  differing by at most one (so at most two compiled group programs)."""
  if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
    raise ValueError(f"dispatch_groups={groups!r} must be an int >= 1 (jitted calls per decoding step)")
  return tuple(tuple(int(l) for l in part) for part in np.array_split(np.arange(n_layers), min(groups, n_layers)))


@functools.partial(jax.jit, static_argnames=("cfg", "method", "phase", "layout"), donate_argnames=("sts",))
def _layers(lps, x, lengths, rope, sts, rows=None, *, cfg, method, phase, layout=None):
  """Consecutive layers in one call; their states are donated. rows: for each layer i of the group, the
  (k, v) [B, K, X, H] fetched for its state's κ (rows[i] a pair or one [2, B, K, X, H] array; all of rows
  may be one [G, 2, B, K, X, H] array, as the numpy store delivers a group), installed first; None keeps the
  rows each state holds."""
  out = []
  for i, (lp, st) in enumerate(zip(lps, sts)):
    if rows is not None:
      st = sc.with_fetched(st, st.kappa, *rows[i])
    x, st, _ = dec.layer_forward(cfg, method, lp, x, lengths, st, phase, rope)
    out.append(_keep(st, layout))
  return x, tuple(out)


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def _kappa_for_step(lp, x, lengths, rope, st, *, cfg, method):
  q, k, v = dec.attention_inputs(cfg, lp, x, rope)
  return sc.kappa_for_step(method, st, q, k, v, lengths)


@functools.partial(jax.jit, static_argnames=("method",))
def _observe(states, missed_B, tokens_BS, lengths_B, inp_BW, *, method):
  """The rows whose guesses missed (or None) and, with anchor_rows, where the input's rows copy from (the ids
  stored before it). Not donating: the host store's worker may still read the states' κ of pending fetches (jit
  forwards the unchanged leaves without a copy)."""
  return observe_speculation(method, states, missed_B, decode.input_anchors(method, tokens_BS, lengths_B, inp_BW))


@functools.partial(jax.jit, donate_argnums=0)
def _with_fetched(st, kappa, rows):
  return sc.with_fetched(st, kappa, *rows)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "phase"))
def _embed(params, tokens, lengths, *, cfg, method, phase):
  """The step's inputs to the first layer and the RoPE tables every layer shares."""
  t = tokens.shape[1]
  return dec.embed(params, tokens), dec.rope_for(cfg, phase, lengths, t, dec.row_offsets(method, phase, t))


@functools.partial(jax.jit, donate_argnums=0)
def _record(tokens_BS, inp_BW, lengths_B):
  return history.write_rows(tokens_BS, inp_BW[:, :1], lengths_B)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head(params, x, rows, *, cfg):
  x = jnp.take_along_axis(x, rows[:, None, None], axis=1)
  return dec.lm_head(params, cfg, x)[:, 0]                                  # [B, V]


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def _sample_next(params, x, rng, inp, done, spec, tokens, lengths, *, cfg, method):
  """The protocol's step tail on the device: sample, next input, speculation outcome. tokens, lengths: the ids
  stored after the step and their count (`OffloadRuntime.tokens`; None without lookup)."""
  logits = dec.lm_head(params, cfg, x)                                      # [B, W, V]
  nxt = jnp.where(done, spec.pad_id, decode.sample(logits[:, 0], rng, spec))
  hits, steps, missed = decode.speculation(method, inp, nxt, ~done)
  return nxt, decode.next_input(method, inp, nxt, logits, tokens, lengths), hits, steps, missed


@dataclasses.dataclass
class Timings:
  prefill_s: float = 0.0
  decode_s: float = 0.0
  steps: int = 0


class OffloadRuntime:
  """Generation with the 16-bit cache in host memory. One instance per (model, method, batch, max_len).

  mesh: lay params, per-layer states and the host store out on a ("data", "model") mesh (sharding.py).
  check_numerics: after every phase, check each layer's device state and the hidden state and raise
    guards.NonFiniteError at the first bad step (it waits for each step: for debugging, not timing).
  dispatch_groups: jitted calls per decoding step (`layer_groups`); each group's κ_{t+1} rows come back as
    one host gather and one transfer. 1 would fetch every layer only after the whole step: keep it >= 2.
  prefill_rows: sequences prefilled at a time (each chunk runs all layers; its activations are what the memory
    plan counts); None: the most that fit the accelerator next to the weights and the cache
    (`offload.plan_memory`). Not on a mesh (the batch is sharded there): every sequence at once."""

  def __init__(self, params, cfg, method, batch: int, max_len: int, prompt_len: int | None = None,
               device=None, check_memory: bool = True, mesh: Mesh | None = None, check_numerics: bool = False,
               dispatch_groups: int = DISPATCH_GROUPS, prefill_rows: int | None = None):
    if not method.offload:
      raise ValueError(f"the offload runtime needs a SpeCache config with offload=True; got {method!r}")
    self.cfg, self.method, self.batch, self.max_len = cfg, method, batch, max_len
    self.groups = layer_groups(cfg.n_layers, dispatch_groups)
    self.mesh, self.check_numerics = mesh, check_numerics
    if mesh is not None:
      params = sharding.shard_params(params, cfg, mesh)
      device = mesh.devices.flat[0]
    self.device = device or jax.devices()[0]
    self.dtype = params["embed"].dtype
    if mesh is not None and prefill_rows not in (None, batch):
      raise ValueError(f"prefill_rows={prefill_rows!r}: on a mesh the runtime prefills the whole (sharded) "
                       f"batch of {batch} at once")
    self.plan = offload.plan_memory(cfg, method, params, batch, max_len, self.dtype, prompt_len or max_len,
                                    device=self.device, prefill_rows=batch if mesh is not None else prefill_rows)
    if check_memory:
      self.plan.check()
    self.params = params
    self.layer_params = dec.unstack_layers(params["layers"], cfg.n_layers)
    self.group_params = [tuple(self.layer_params[l] for l in g) for g in self.groups]
    self.store = None
    self.states = None
    self.tokens = None           # [B, S] int32 ids of the stored tokens, for a method with lookup (history.py)
    self._stored = None          # numpy [B]: rows stored per batch row, counted on the host (no device sync)
    self.timings = Timings()
    self._step_index = 0

  def _init(self):
    st = self.method.impl.init(self.method, self.cfg, self.batch, self.max_len, self.dtype)
    self.states = list(dec.unstack_layers(st, self.cfg.n_layers))
    self.layout = None
    if self.mesh is not None:
      specs = sharding.layer_state_specs(self.states[0], self.cfg.n_kv_heads)
      self.layout = sharding.named(self.mesh, specs)
      self.states = [jax.device_put(s, self.layout) for s in self.states]
    if self.store is not None:
      self.store.close()
    self.store = offload.make_store(self.method.host_store, self.cfg.n_layers, self.batch, self.cfg.n_kv_heads,
                                    self.method.slots(self.max_len), self.cfg.head_dim, self.dtype, self.device,
                                    mesh=self.mesh)

  def device_bytes(self) -> int:
    return int(sum(self.method.device_bytes(s) for s in self.states))

  def _guard(self, step: int, phase: str, x):
    """Steps are numbered as in the jitted loop: 0 the prefill, 1 the pre-decoding pass and decoding step 1."""
    if self.check_numerics:
      guards.check_layers(step, phase, self.states, x)

  def prefill(self, tokens_BT, lengths_B):
    self._init()
    self._step_index = 0
    self._stored = np.asarray(lengths_B).astype(np.int64)
    if self.method.speculation.keeps_tokens:
      self.tokens = history.write_prompt(history.empty(self.batch, self.method.slots(self.max_len)),
                                         jnp.asarray(tokens_BT))
    kw = dict(cfg=self.cfg, method=self.method, layout=self.layout)
    rows, logits = self.plan.prefill_rows or self.batch, []
    for r0 in range(0, self.batch, rows):                     # sequences in chunks: bounded activations
      r1 = min(self.batch, r0 + rows)
      toks, lens = tokens_BT[r0:r1], lengths_B[r0:r1]
      x, rope = _embed(self.params, toks, lens, cfg=self.cfg, method=self.method, phase="prefill")
      for l, lp in enumerate(self.layer_params):
        x, self.states[l], k, v = _prefill_layer(lp, x, lens, rope, self.states[l],
                                                 None if rows == self.batch else np.int32(r0), **kw)
        self.store.write_prompt(l, k, v, row0=r0)
      logits.append(_head(self.params, x, lens - 1, cfg=self.cfg))
    logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits)
    self._guard(0, "prefill", logits)
    return logits

  def _run_group(self, g, x, lengths_B, rope, rows, phase):
    """Group g's layers in one call (states donated and replaced) -> x."""
    layers = self.groups[g]
    x, sts = _layers(self.group_params[g], x, lengths_B, rope, tuple(self.states[l] for l in layers), rows,
                     cfg=self.cfg, method=self.method, phase=phase, layout=self.layout)
    self.states[layers[0]:layers[-1] + 1] = sts
    return x

  def _fetch_group(self, g):
    """Issue the host gather + transfer of group g's κ rows (the states' current κ) -> a pending fetch."""
    return self.store.fetch(self.groups[g], tuple(self.states[l].kappa for l in self.groups[g]))

  def predecode(self, first_B, lengths_B):
    """T1 over the low-bit copy; issues the fetch of κ_1 per layer group right after that group."""
    pending = []
    if self.method.speculation.anchor_rows:                                          # κ_1 is T1's: its own anchor
      self.states = list(_observe(tuple(self.states), None, self.tokens, lengths_B, first_B[:, None],
                                  method=self.method))
    x, rope = _embed(self.params, first_B[:, None], lengths_B, cfg=self.cfg, method=self.method, phase="predecode")
    for g in range(len(self.groups)):
      x = self._run_group(g, x, lengths_B, rope, None, "predecode")
      pending.append(self._fetch_group(g))
    self._guard(1, "predecode", x)
    return x, pending

  def _critical_path_group(self, g, x, lengths_B, rope, rows):
    """Group g layer by layer, each choosing κ_t from the real row and fetching it before its attend."""
    kw = dict(cfg=self.cfg, method=self.method)
    rope_1 = jax.tree.map(lambda r: r[:, :1], rope)
    for i, l in enumerate(self.groups[g]):
      st = self.states[l]
      if rows is not None:
        st = _with_fetched(st, st.kappa, rows[i])                        # the prefetched rows
      kappa = _kappa_for_step(self.layer_params[l], x[:, :1], lengths_B, rope_1, st, **kw)
      st = _with_fetched(st, kappa, self.store.fetch((l,), (kappa,)).result()[0])
      x, (self.states[l],) = _layers((self.layer_params[l],), x, lengths_B, rope, (st,), None, phase="decode",
                                     layout=self.layout, **kw)
    return x

  def step(self, inp_BW, lengths_B, pending, miss_B=None):
    """One decoding step over all layers; returns (x [B, W, D], next pending fetches, one per layer group).
    lengths_B: the rows stored before this step (may stay on the device: which rings fill is counted on the host
    from prefill's).

    miss_B (numpy bool [B]): rows whose speculative token was wrong; with exact_on_miss they get the real
    row's own top-k fetched synchronously instead of the prefetched rows."""
    method = self.method
    spec = method.speculation
    self._step_index += 1
    miss = jnp.asarray(miss_B) if spec.exact_on_miss and spec.speculative and miss_B is not None else None
    if miss is not None or method.speculation.anchor_rows:
      self.states = list(_observe(tuple(self.states), miss, self.tokens, lengths_B, inp_BW, method=method))
    sync = spec.fetches_on_critical_path and (not spec.speculative or bool(np.any(miss_B)))
    x, rope = _embed(self.params, inp_BW, lengths_B, cfg=self.cfg, method=self.method, phase="decode")
    if self.tokens is not None:                                          # the real row is stored at lengths
      self.tokens = _record(self.tokens, inp_BW, lengths_B)
    stored = self._stored + 1             # rows stored after this step (host count: lengths_B stays on device)
    flushed = np.flatnonzero(stored % method.residual == 0)               # their ring holds a whole block
    nxt_pending = []
    for g, layers in enumerate(self.groups):
      rows = pending[g].result() if spec.speculative else None           # κ_t prefetched during step t-1
      if sync:
        x = self._critical_path_group(g, x, lengths_B, rope, rows)
      else:
        x = self._run_group(g, x, lengths_B, rope, rows, "decode")
      if flushed.size:                                                   # rings just filled: R rows each
        for l in layers:
          st = self.states[l]
          self.store.write_block(l, st.low.ring_k, st.low.ring_v, stored - method.residual, flushed)
      if spec.speculative:
        nxt_pending.append(self._fetch_group(g))                          # κ_{t+1}: overlaps groups g+1..
    self._stored = stored
    self._guard(self._step_index, "decode", x)
    return x, nxt_pending

  def generate(self, tokens_BT, lengths_B, max_new_tokens: int, rng, temperature=0.0, top_p=1.0,
               stop_tokens=(), pad_id=0) -> decode.GenerateOutput:
    spec = decode.SamplingSpec.make(temperature, top_p, stop_tokens, pad_id)
    method = self.method
    lengths = jnp.asarray(lengths_B, jnp.int32)
    t0 = time.perf_counter()
    logits = self.prefill(jnp.asarray(tokens_BT), lengths)
    rng, sub = jax.random.split(rng)
    first = decode.sample(logits, sub, spec)
    if method.speculation.predecodes:
      x, pending = self.predecode(first, lengths)
      head = _head(self.params, x, jnp.zeros_like(lengths), cfg=self.cfg)
      inp = decode.first_input(method, first, decode.guesses(
          method, head, decode.lookup_guess(method, self.tokens, lengths, first)))
    else:
      pending, inp = None, decode.first_input(method, first)
    jax.block_until_ready(inp)
    t1 = time.perf_counter()
    out = [np.asarray(first)]
    done = np.isin(out[0], spec.stop_tokens)
    num = np.ones_like(out[0], dtype=np.int32)
    spec_hits = spec_steps = 0.0
    miss = None
    for _ in range(1, max_new_tokens):
      if done.all():
        break
      x, pending = self.step(inp, lengths, pending, miss)
      rng, sub = jax.random.split(rng)
      nxt, inp, hits, steps, missed = _sample_next(self.params, x, sub, inp, jnp.asarray(done), spec, self.tokens,
                                                   lengths + 1, cfg=self.cfg, method=method)
      nxt_np = np.asarray(nxt)                                              # the one sync of a step
      miss = np.asarray(missed) if method.speculation.width > 1 else None
      spec_hits += float(hits)
      spec_steps += float(steps)
      num += (~done).astype(np.int32)
      out.append(nxt_np)
      done = done | np.isin(nxt_np, spec.stop_tokens)
      lengths = lengths + 1
      self.timings.steps += 1
    jax.block_until_ready(self.states)
    t2 = time.perf_counter()
    self.timings.prefill_s, self.timings.decode_s = t1 - t0, t2 - t1
    tokens = np.full((self.batch, max_new_tokens), spec.pad_id, np.int32)
    tokens[:, :len(out)] = np.stack(out, axis=1)
    stats = {"spec_token_hits": np.float32(spec_hits), "spec_token_steps": np.float32(spec_steps)}
    return decode.GenerateOutput(tokens=jnp.asarray(tokens), num_tokens=jnp.asarray(num), stats=stats)
