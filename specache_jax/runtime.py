"""The offloaded runtime: the 16-bit cache in the host store, dispatch in layer groups that overlaps SpeCache's κ
fetch with compute. It runs any method whose module is a `caches.base.OffloadModule` (SpeCache, Quest, InfLLM):
the hooks name the rows fetched, how they enter the state and what is flushed to the host; κ below is the rows a
step reads from the host (SpeCache's κ, Quest's pages, InfLLM's blocks).

The layers run in a few consecutive groups (`layer_groups`; 5 calls per step by default), one jitted call per
group: each call is a Python dispatch, and on a 2-core CPU or in front of a GPU the dispatching thread's time is
not free. Step t, group g (all calls return at once under JAX's asynchronous dispatch; nothing blocks the loop):
  1. κ_t: take group g's rows fetched during step t-1 (double buffer: `pending[g]`), or — a method that does not
     prefetch (SpeCache non-speculative, Quest, InfLLM: their rows come from the step's own query), or
     exact_on_miss after a wrong guess — choose each layer's κ_t from the real row now (the method's
     `kappa_for_step`) and fetch it synchronously, layer by layer (the fetch on the critical path);
  2. run the group's layers (the decoder's own per-layer function; SpeCache's `attend` with offload=True attends
     with the fetched rows, stores the real row on the device side and records κ_{t+1}), each after its
     speculation's `observe` hook saw the last step's outcome; their states are donated (updated in place) — only
     after `pending[g]` is waited on, so the worker has read their κ;
  3. write the rows the method flushes (`flushes`, counted on the host) to the host store: SpeCache's residual
     ring when it has just filled (every R steps: its R 16-bit rows at once; the host only ever serves κ rows
     below the ring's 16-bit keys: exactly the flushed rows), Quest's current page when it fills, InfLLM's block
     as it leaves the local window;
  4. (methods that prefetch) issue the gather of the group's κ_{t+1} rows on the host and their
     `jax.device_put` (one block per group) — before group g+1 is dispatched, so the transfer runs while groups
     g+1.. of step t compute; it is needed only by group g of step t+1.
Then the step's tail is the jitted loop's (`decode.finish_step`, one call): sampling, stop tokens, the next input,
the speculation outcome and the method's statistics on a `decode.DecodeState`, all left on the device.

Host reads. The dispatching thread reads a device value only through `OffloadRuntime.read` (counted in
`host_reads`), and only where the algorithm needs it: exact_on_miss reads whether any row missed before the next
step's attention; `generate` reads the stop condition once every `sync_every` steps, from a flag whose copy to the
host started a step earlier (extra steps past all-done only write the pad id). A speculative step that hits reads
nothing: the κ it needs next arrives through the host store's worker (the numpy store starts each κ's copy to the
host as the group is dispatched, so the worker's read does not hold the dispatching thread). The SpeCache step itself is
written once, in caches/specache.py, reached through `method.impl` (the `OffloadModule` hooks); here only the
fetches differ (host store instead of a device gather). Quest and InfLLM have no speculative token: every step
of theirs waits, layer by layer, for the rows its own query chose.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specache_jax import decode, guards, history, offload, sharding
from specache_jax.caches.base import Cache
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


@functools.partial(jax.jit, static_argnames=("method", "repeat", "layout"), donate_argnames=("st",))
def _install_layer(st, k, v, lengths, colsum=None, *, method, repeat, layout=None):
  """One layer's state after the prefill of k, v [B/repeat, T, K, H] (each row repeated `repeat` times)."""
  rep = lambda a: None if a is None else jnp.repeat(a, repeat, axis=0)
  return _keep(method.impl.prefill(method, st, rep(k), rep(v), lengths, rep(colsum)), layout)


DISPATCH_GROUPS = 5       # jitted calls per decoding step (OffloadRuntime's default)


def layer_groups(n_layers: int, groups: int) -> tuple[tuple[int, ...], ...]:
  """Layers 0..n_layers-1 as `groups` runs of consecutive layers (fewer when there are fewer layers), sizes
  differing by at most one (so at most two compiled group programs)."""
  if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
    raise ValueError(f"dispatch_groups={groups!r} must be an int >= 1 (jitted calls per decoding step)")
  return tuple(tuple(int(l) for l in part) for part in np.array_split(np.arange(n_layers), min(groups, n_layers)))


def _observed(method, st, obs):
  """One layer's state after the method's hook saw `obs` (`decode.observation`; None: unchanged)."""
  return st if obs is None else method.speculation.observe(st, *obs)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "phase", "layout"), donate_argnames=("sts",))
def _layers(lps, x, lengths, rope, sts, rows=None, obs=None, *, cfg, method, phase, layout=None):
  """Consecutive layers in one call; their states are donated. rows: for each layer i of the group, the
  (k, v) [B, K, X, H] fetched for its state's κ (rows[i] a pair or one [2, B, K, X, H] array; all of rows
  may be one [G, 2, B, K, X, H] array, as the numpy store delivers a group), installed first; None keeps the
  rows each state holds. obs: what each layer's hook is told first (`decode.observation`, or None).
  -> (x, states, each layer's aux)."""
  out, auxes = [], []
  for i, (lp, st) in enumerate(zip(lps, sts)):
    st = _observed(method, st, obs)
    if rows is not None:
      st = method.impl.with_fetched(method, st, method.impl.next_index(method, st), *rows[i])
    x, st, aux = dec.layer_forward(cfg, method, lp, x, lengths, st, phase, rope)
    out.append(_keep(st, layout))
    auxes.append(aux)
  return x, tuple(out), tuple(auxes)


@functools.partial(jax.jit, static_argnames=("method",), donate_argnums=0)
def _prepared(st, rows, obs, *, method):
  """A layer's state before a critical-path step: its hook told `obs`, the prefetched rows (or None) installed."""
  st = _observed(method, st, obs)
  return st if rows is None else method.impl.with_fetched(method, st, method.impl.next_index(method, st), *rows)


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def _kappa_for_step(lp, x, lengths, rope, st, *, cfg, method):
  q, k, v = dec.attention_inputs(cfg, lp, x, rope)
  return method.impl.kappa_for_step(method, st, q, k, v, lengths)


@functools.partial(jax.jit, static_argnames=("method",))
def _observation(missed_B, tokens_BS, lengths_B, inp_BW, *, method):
  return decode.observation(method, missed_B, tokens_BS, lengths_B, inp_BW)


@functools.partial(jax.jit, static_argnames=("method",))
def _predecode_observation(first_B, tokens_BS, lengths_B, *, method):
  return decode.predecode_observation(method, first_B, tokens_BS, lengths_B)


@functools.partial(jax.jit, static_argnames=("method",), donate_argnums=0)
def _with_fetched(st, kappa, rows, *, method):
  return method.impl.with_fetched(method, st, kappa, *rows)


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


_first = jax.jit(decode.first_token)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_new_tokens"))
def _begin(params, x_B1D, first_B, rng, spec, tokens_BS, lengths_B, lp, st, *, cfg, method, max_new_tokens):
  """The state before decoding step 1 (`decode.begin_state`): the first input from the pre-decoding pass's
  hidden state x (None without one). lp, st: a layer's params and state, for the shapes of a step's aux. The
  state's cache holds the lengths only: the layer states and the ids stay the runtime's."""
  logits = None if x_B1D is None else dec.lm_head(params, cfg, x_B1D)[:, 0]
  inp = decode.start_input(method, first_B, logits, tokens_BS, lengths_B)
  def step_aux(x):
    rope = dec.rope_for(cfg, "decode", lengths_B, x.shape[1], method.speculation.row_offsets(x.shape[1]))
    return dec.layer_forward(cfg, method, lp, x, lengths_B, st, "decode", rope)[2]
  aux = jax.eval_shape(step_aux, dec.embed(params, inp))
  aux_LB = jax.tree.map(lambda a: jax.ShapeDtypeStruct((cfg.n_layers,) + a.shape, a.dtype), aux)
  return decode.begin_state(method, Cache(layers=(), lengths=lengths_B), first_B, inp, rng, spec, max_new_tokens,
                            aux_LB)


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("state",))
def _finish(params, x_BWD, auxes, state, tokens_BS, spec, *, cfg, method):
  """`decode.finish_step` after the runtime's layers: the lengths advance as `decoder.forward`'s do; the ids
  after the step (`OffloadRuntime.tokens`; None without lookup) are read, not kept in the state."""
  stored_B = method.speculation.rows_stored(state.inp.shape[1], "decode")
  after = Cache(layers=(), lengths=state.cache.lengths + stored_B, tokens=tokens_BS)
  aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes and auxes[0] else {}
  state = decode.finish_step(method, state, after, dec.lm_head(params, cfg, x_BWD), aux, spec)
  return state.replace(cache=after.replace(tokens=None))


_all_done = jax.jit(jnp.all)          # the stop condition as a fresh scalar (the state's `done` is donated)

SYNC_EVERY = 8            # decoding steps between `generate`'s reads of the stop condition (OffloadRuntime's default)


class OffloadRuntime:
  """Generation with the 16-bit cache in host memory. One instance per (model, method, batch, max_len).

  mesh: lay params, per-layer states and the host store out on a ("data", "model") mesh (sharding.py).
  check_numerics: after every phase, check each layer's device state and the hidden state and raise
    guards.NonFiniteError at the first bad step (it waits for each step: for debugging, not timing).
  dispatch_groups: jitted calls per decoding step (`layer_groups`); each group's κ_{t+1} rows come back as
    one host gather and one transfer. 1 would fetch every layer only after the whole step: keep it >= 2.
  prefill_rows: sequences prefilled at a time (each chunk runs all layers; its activations are what the memory
    plan counts); None: the most that fit the accelerator next to the weights and the cache
    (`offload.plan_memory`). Not on a mesh (the batch is sharded there): every sequence at once.
  sync_every: `generate` reads whether every row is done once every this many decoding steps (a flag issued
    after such a step, its copy to the host started then, read after the next step is dispatched): up to
    sync_every steps run past the last row's stop token, writing the pad id (tokens and statistics unchanged).

  host_reads counts the device -> host reads of the dispatching thread (`read`): the stop checks, prefill's
  lengths and exact_on_miss's miss flags; a speculative step that hits makes none."""

  def __init__(self, params, cfg, method, batch: int, max_len: int, prompt_len: int | None = None,
               device=None, check_memory: bool = True, mesh: Mesh | None = None, check_numerics: bool = False,
               dispatch_groups: int = DISPATCH_GROUPS, prefill_rows: int | None = None,
               sync_every: int = SYNC_EVERY):
    if not method.offload:
      raise ValueError(f"the offload runtime needs a method config with offload=True; got {method!r}")
    self.cfg, self.method, self.batch, self.max_len = cfg, method, batch, max_len
    self.groups = layer_groups(cfg.n_layers, dispatch_groups)
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
      raise ValueError(f"sync_every={sync_every!r} must be an int >= 1 (decoding steps between stop checks)")
    self.sync_every = sync_every
    self.prefetches = method.impl.prefetches(method)                # κ_{t+1} fetched during step t
    self.reads_misses = self.prefetches and method.impl.fetches_on_critical_path(method)   # exact_on_miss
    self.host_reads = 0          # device -> host reads on the dispatching thread (`read`)
    self.mesh, self.check_numerics = mesh, check_numerics
    if mesh is not None:
      params = sharding.shard_params(params, cfg, mesh)
      device = sharding.first_local_device(mesh)
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

  def read(self, x) -> np.ndarray:
    """x on the host (for a device array, a wait for it on the dispatching thread, counted in `host_reads`): every
    device -> host read the runtime makes goes through here."""
    if isinstance(x, jax.Array):
      self.host_reads += 1
    return np.asarray(x)

  def _waits_for_kappa(self, miss_B) -> bool:
    """Whether a step chooses its κ_t from the real row and waits for that fetch (`_critical_path_group`): the
    non-speculative ablation every step, exact_on_miss when some row's guesses all missed (miss_B, numpy or a
    device array: read on the host, the one read the algorithm needs before the step's attention); every step of
    a method that does not prefetch (Quest, InfLLM)."""
    method = self.method
    if not method.impl.fetches_on_critical_path(method):
      return False
    if not self.prefetches:
      return True
    return miss_B is not None and bool(np.any(self.read(miss_B)))

  def device_bytes(self) -> int:
    return int(sum(self.method.device_bytes(s) for s in self.states))

  def _guard(self, step: int, phase: str, x):
    """Steps are numbered as in the jitted loop: 0 the prefill, 1 the pre-decoding pass and decoding step 1."""
    if self.check_numerics:
      guards.check_layers(step, phase, self.states, x)

  def _new_prompt(self, tokens_BT, lengths_B):
    """Fresh states and host store for a new batch of prompts (their ids kept where the method looks them up)."""
    self._init()
    self._step_index = 0
    self._stored = self.read(lengths_B).astype(np.int64)
    if self.method.speculation.keeps_tokens:
      self.tokens = history.write_prompt(history.empty(self.batch, self.method.slots(self.max_len)),
                                         jnp.asarray(tokens_BT))

  def prefill(self, tokens_BT, lengths_B):
    self._new_prompt(tokens_BT, lengths_B)
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

  def install_prompt(self, k_LBTKH, v_LBTKH, lengths_B, tokens_BT=None, repeat: int = 1, colsum_LBKT=None):
    """The state `prefill` leaves, from the prompts' post-RoPE K/V computed elsewhere (a benchmark's one prefill,
    experiments/lib/bench/states.py) instead of from the layers: each layer's state is the method's own
    `prefill` of those rows, their 16-bit rows go to the host store. repeat: each given row stands for `repeat`
    consecutive rows of the batch (copied one layer at a time); lengths_B, tokens_BT: the whole batch's. The
    caller holds the first generated token (the prefill's logits are not computed here)."""
    if k_LBTKH.shape[1] * repeat != self.batch:
      raise ValueError(f"{k_LBTKH.shape[1]} rows x {repeat=} must make the runtime's batch={self.batch}")
    self._new_prompt(tokens_BT, lengths_B)
    lengths = jnp.asarray(lengths_B, jnp.int32)
    for l in range(self.cfg.n_layers):
      colsum = None if colsum_LBKT is None or not self.method.needs_attention_colsum else colsum_LBKT[l]
      self.states[l] = _install_layer(self.states[l], k_LBTKH[l], v_LBTKH[l], lengths, colsum, method=self.method,
                                      repeat=repeat, layout=self.layout)
      for r in range(self.batch):
        src = r // repeat
        self.store.write_prompt(l, k_LBTKH[l, src:src + 1], v_LBTKH[l, src:src + 1], row0=r)

  def _run_group(self, g, x, lengths_B, rope, rows, phase, obs=None):
    """Group g's layers in one call (states donated and replaced) -> (x, each layer's aux)."""
    layers = self.groups[g]
    x, sts, auxes = _layers(self.group_params[g], x, lengths_B, rope, tuple(self.states[l] for l in layers), rows,
                            obs, cfg=self.cfg, method=self.method, phase=phase, layout=self.layout)
    self.states[layers[0]:layers[-1] + 1] = sts
    return x, auxes

  def _fetch_group(self, g):
    """Issue the host gather + transfer of group g's κ rows (the states' current κ) -> a pending fetch."""
    next_index = self.method.impl.next_index
    return self.store.fetch(self.groups[g], tuple(next_index(self.method, self.states[l]) for l in self.groups[g]))

  def predecode(self, first_B, lengths_B):
    """T1 over the low-bit copy; issues the fetch of κ_1 per layer group right after that group."""
    pending = []
    obs = _predecode_observation(first_B, self.tokens, lengths_B, method=self.method)   # κ_1 is T1's (anchors)
    x, rope = _embed(self.params, first_B[:, None], lengths_B, cfg=self.cfg, method=self.method, phase="predecode")
    for g in range(len(self.groups)):
      x, _ = self._run_group(g, x, lengths_B, rope, None, "predecode", obs)
      pending.append(self._fetch_group(g))
    self._guard(1, "predecode", x)
    return x, pending

  def _critical_path_group(self, g, x, lengths_B, rope, rows, obs):
    """Group g layer by layer, each choosing κ_t from the real row and fetching it before its attend."""
    kw = dict(cfg=self.cfg, method=self.method)
    rope_1 = jax.tree.map(lambda r: r[:, :1], rope)
    auxes = []
    for i, l in enumerate(self.groups[g]):
      # Donated here only when there is something to install; else first after this layer's fetch is waited on,
      # when the worker (FIFO) has written the rows a flush passed from this state.
      st = self.states[l]
      if rows is not None or obs is not None:
        st = _prepared(st, None if rows is None else rows[i], obs, method=self.method)
      kappa = _kappa_for_step(self.layer_params[l], x[:, :1], lengths_B, rope_1, st, **kw)
      st = _with_fetched(st, kappa, self.store.fetch((l,), (kappa,)).result()[0], method=self.method)
      x, (self.states[l],), aux = _layers((self.layer_params[l],), x, lengths_B, rope, (st,), None, None,
                                          phase="decode", layout=self.layout, **kw)
      auxes += aux
    return x, tuple(auxes)

  def step(self, inp_BW, lengths_B, pending, miss_B=None):
    """One decoding step over all layers; returns (x [B, W, D], each layer's aux, next pending fetches, one per
    layer group). lengths_B: the rows stored before this step (may stay on the device: which rings fill is
    counted on the host from prefill's).

    miss_B ([B] bool, numpy or on the device; None: not told): rows whose speculative guesses of inp's real token
    were all wrong, for the method's speculation's `observe` hook; with exact_on_miss they get the real row's own
    top-k fetched synchronously instead of the prefetched rows (whether any row missed is read on the host)."""
    method = self.method
    self._step_index += 1
    obs = _observation(None if miss_B is None else jnp.asarray(miss_B), self.tokens, lengths_B, inp_BW,
                       method=method)
    sync = self._waits_for_kappa(miss_B)
    x, rope = _embed(self.params, inp_BW, lengths_B, cfg=self.cfg, method=self.method, phase="decode")
    if self.tokens is not None:                                          # the real row is stored at lengths
      self.tokens = _record(self.tokens, inp_BW, lengths_B)
    stored = self._stored + 1             # rows stored after this step (host count: lengths_B stays on device)
    flushed, flush_start = method.impl.flushes(method, stored)            # e.g. their ring holds a whole block
    nxt_pending, auxes = [], ()
    for g, layers in enumerate(self.groups):
      rows = pending[g].result() if self.prefetches and pending else None   # κ_t prefetched during step t-1
                                                          # (none: step 1 without pre-decoding has no κ_1)
      if sync:
        x, aux = self._critical_path_group(g, x, lengths_B, rope, rows, obs)
      else:
        x, aux = self._run_group(g, x, lengths_B, rope, rows, "decode", obs)
      auxes += aux
      if flushed.size:                                                   # e.g. rings just filled: R rows each
        for l in layers:
          k, v = method.impl.flushed_rows(method, self.states[l], flush_start)
          self.store.write_block(l, k, v, flush_start, flushed)
      if self.prefetches:
        nxt_pending.append(self._fetch_group(g))                          # κ_{t+1}: overlaps groups g+1..
    self._stored = stored
    self._guard(self._step_index, "decode", x)
    return x, auxes, nxt_pending

  def begin(self, tokens_BT, lengths_B, rng, spec: decode.SamplingSpec, max_new_tokens: int):
    """Prefill, the first token, the pre-decoding pass (`predecodes`; else no pending fetch: step 1 attends no
    κ_1) -> (`decode.DecodeState` before step 1, pending fetches or None).
    The state's cache carries the lengths; the layer states, the host store and the ids are the runtime's."""
    lengths = jnp.asarray(lengths_B, jnp.int32)
    logits = self.prefill(jnp.asarray(tokens_BT), lengths)
    first, rng = _first(logits, rng, spec)
    x, pending = self.predecode(first, lengths) if self.method.speculation.predecodes else (None, None)
    state = _begin(self.params, x, first, rng, spec, self.tokens, lengths, self.layer_params[0], self.states[0],
                   cfg=self.cfg, method=self.method, max_new_tokens=max_new_tokens)
    return state, pending

  def advance(self, state: decode.DecodeState, pending, spec: decode.SamplingSpec):
    """One decoding step (`step`) and its tail (`decode.finish_step`) -> (state, pending fetches). The state is
    donated."""
    miss = state.missed if self.method.speculation.width > 1 else None
    x, auxes, pending = self.step(state.inp, state.cache.lengths, pending, miss)
    state = _finish(self.params, x, auxes, state, self.tokens, spec, cfg=self.cfg, method=self.method)
    if self.reads_misses:
      state.missed.copy_to_host_async()              # the next step reads it (`_waits_for_kappa`)
    return state, pending

  def generate(self, tokens_BT, lengths_B, max_new_tokens: int, rng, temperature=0.0, top_p=1.0,
               stop_tokens=(), pad_id=0, clock=None, out_width=None) -> decode.GenerateOutput:
    """clock: a `clock.CallClock` to mark the first token (a wait for it; None: no wait). out_width: the output
    buffer's width (>= max_new_tokens, what the state's programs compile for: `buckets.plan`; None: exact)."""
    spec = decode.SamplingSpec.make(temperature, top_p, stop_tokens, pad_id)
    state, pending = self.begin(tokens_BT, lengths_B, rng, spec, max(out_width or 0, max_new_tokens))
    if clock is not None:
      clock.first_token(state.tokens)
    flag = self._stop_flag(state)                      # read after step 1 is dispatched
    for step in range(1, max_new_tokens):
      state, pending = self.advance(state, pending, spec)
      if flag is not None:
        if self.read(flag):                            # every row was done before this step: it wrote pad ids
          break
        flag = None
      if step % self.sync_every == 0:
        flag = self._stop_flag(state)
    return decode.output(state)

  @staticmethod
  def _stop_flag(state):
    """Whether every row is done, as a device scalar whose copy to the host has started."""
    flag = _all_done(state.done)
    flag.copy_to_host_async()
    return flag
