"""Generation: one decode protocol for every path — the jitted loop, the offload runtime, teacher forcing and
the benchmarks.

  prefill -> first token (sampled: `first_token`) -> `start` (SpeCache: the pre-decoding pass + its speculative
  guess: `start_input`) -> steps: tell the method how the last step's guesses fared (`observation`, its
  speculation's `observe` hook: which rows missed and, with prompt lookup, where the input's rows copy from:
  `input_anchors`) -> decode [T_t(, T'_{t+1})] -> `finish_step`: sample T_{t+1}, stop tokens, `next_input`,
  `speculation` (hits, misses), the method's statistics

What speculation changes here is read from one value, `method.speculation` (caches/speculation.py; one row per
step for every method but SpeCache). With `keeps_tokens` (SpeCache's `lookup`) the cache records its tokens' ids
(`Cache.tokens`, history.py): `next_input` and `start` then take a looked-up guess among the model's
(`lookup_guess`).

Every cache method runs through the same loop; a method that decodes speculative rows beside the real one
(SpeCache: one guess of the next token, or its `candidates` likeliest) has a speculation `width` of 1 + C and the
loop feeds `[T_t, T'_{t+1}, ...]` (the guesses all at position n + 1: its `row_offsets`). A step is
`decode_step` (the jitted loop: the decoder's per-layer loop over a per-layer cache, `decoder.per_layer`, with
per-layer params, so each layer's buffers are updated in place) or the offload runtime's layer groups
(runtime.py: only where κ's rows come from and when they are waited for differ); both end in `finish_step` on
a `DecodeState`. The jitted path is two programs (`start_jit`: prefill, first token, pre-decoding; `loop_jit`:
the decoding steps, the state donated) with one wait for the first token between them when the call is timed.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specache_jax import guards, history, sharding
from specache_jax.caches.base import Cache, CacheConfig
from specache_jax.caches.speculation import observe as _observe
from specache_jax import dispatch as cpu_select      # greedy, top_k: the kernel choice
from specache_jax.model import decoder
from specache_jax.model_config import ModelConfig

SLOT_ROUNDING = 128  # cache slots are rounded up so nearby lengths reuse one compiled program


def slots_for(n_tokens: int, decode_width: int = 2) -> int:
  """Cache slots for `n_tokens` tokens plus one step's extra rows, rounded up to SLOT_ROUNDING."""
  need = n_tokens + decode_width
  return -(-need // SLOT_ROUNDING) * SLOT_ROUNDING


@struct.dataclass
class SamplingSpec:
  """How the next token is chosen. temperature/top_p are traced (changing them does not recompile)."""
  temperature: jax.Array                                             # [] float32; 0 with greedy
  top_p: jax.Array                                                   # [] float32 nucleus mass
  greedy: bool = struct.field(pytree_node=False, default=True)       # argmax instead of sampling
  stop_tokens: tuple = struct.field(pytree_node=False, default=())   # a row is done after one of these
  pad_id: int = struct.field(pytree_node=False, default=0)           # written after a row is done

  @classmethod
  def make(cls, temperature: float = 0.0, top_p: float = 1.0, stop_tokens=(), pad_id: int = 0):
    return cls(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p), greedy=float(temperature) == 0.0,
               stop_tokens=tuple(int(s) for s in stop_tokens), pad_id=int(pad_id))


@struct.dataclass
class GenerateOutput:
  tokens: jax.Array        # [B, M] int32; after a stop token, the row repeats `pad_id`
  num_tokens: jax.Array    # [B] int32 tokens generated up to and including the first stop token
  stats: dict              # method statistics summed over steps and rows, leaves [L] (plus "steps", "spec_*")


@struct.dataclass
class DecodeState:
  """What the jitted decode loop carries from one step to the next."""
  step: jax.Array          # [] int32: the output column the next sampled token goes to
  cache: Cache             # per-layer layout (decoder.per_layer)
  inp: jax.Array           # [B, W] int32 next input: the real token (and the speculative guess)
  tokens: jax.Array        # [B, M] int32 output so far
  done: jax.Array          # [B] bool: the row sampled a stop token
  num_tokens: jax.Array    # [B] int32
  rng: jax.Array           # PRNG key
  stats: dict              # the method's aux summed over steps and active rows, leaves [L]
  spec_hits: jax.Array     # [] float32 steps whose speculative token was the sampled one (active rows)
  spec_steps: jax.Array    # [] float32 active row-steps with a speculative token
  missed: jax.Array        # [B] bool: every guess of the last sampled token was wrong (told to the method
                           # before the next step: `observation`)
  record: jax.Array        # [3] int32 guards' first non-finite record (-1 while finite)


def sample(logits_BV, rng, spec: SamplingSpec):
  """Greedy (argmax) or temperature + nucleus sampling with an explicit PRNG key -> [B] int32."""
  if spec.greedy:
    return cpu_select.greedy(logits_BV)
  logits = logits_BV / jnp.maximum(spec.temperature, 1e-6)
  order = jnp.argsort(-logits, axis=-1)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs                 # mass strictly before each candidate
  sorted_logits = jnp.where(before < spec.top_p, sorted_logits, -jnp.inf)   # the top candidate always stays
  choice = jax.random.categorical(rng, sorted_logits, axis=-1)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def is_stop(tok_B, spec: SamplingSpec):
  """[B] bool: the token is one of the stop tokens."""
  if not spec.stop_tokens:
    return jnp.zeros(tok_B.shape, bool)
  return jnp.any(tok_B[:, None] == jnp.asarray(spec.stop_tokens, jnp.int32)[None, :], axis=-1)


def guess(logits_BV):
  """The greedy guess of the next token -> [B] int32."""
  return cpu_select.greedy(logits_BV)


def guesses(method: CacheConfig, logits_BV, looked_up_B=None):
  """A speculative method's guesses of the next token: its speculation width - 1 likeliest, best first -> [B, C]
  int32 (one: `guess`). looked_up_B [B] int32 (`lookup_guess`; `history.NONE` where none): replaces the last
  guess where it is not one of them already."""
  c = method.speculation.width - 1
  top_BC = guess(logits_BV)[:, None] if c == 1 else cpu_select.top_k(logits_BV, c)
  if looked_up_B is None:
    return top_BC
  new_B = (looked_up_B != history.NONE) & ~jnp.any(top_BC == looked_up_B[:, None], axis=-1)
  return top_BC.at[:, -1].set(jnp.where(new_B, looked_up_B, top_BC[:, -1]))


def lookup_guess(method: CacheConfig, tokens_BS, lengths_B, next_B):
  """The guess looked up in the tokens so far (`history.lookup` with the method's n-gram; the sequence is the
  cache's `lengths` tokens then `next`), or None for a method without `lookup`."""
  if not method.speculation.keeps_tokens:
    return None
  if tokens_BS is None:
    raise ValueError(f"{method.name} with lookup={method.speculation.lookup} needs the cache's token ids "
                     "(Cache.tokens); build the cache with decode.init_cache")
  return history.lookup(tokens_BS, lengths_B, next_B, method.speculation.lookup)


def first_input(method: CacheConfig, first_B, guesses_BC=None):
  """The first decoding input [B, W]: [T1] or, for a speculative method, [T1, its guesses of T2]."""
  if method.speculation.width > 1:
    return jnp.concatenate([first_B[:, None], guesses_BC], axis=1)
  return first_B[:, None]


def next_input(method: CacheConfig, inp_BW, nxt_B, logits_BWV, tokens_BS=None, lengths_B=None):
  """The next decoding input [B, W] from this step's input, the sampled token and this step's logits: the next
  guesses come from the speculative row whose guess was the sampled token (its logits saw the right
  history), else from the first candidate's (one guess: always its row). tokens_BS, lengths_B: the token ids
  stored after this step and their count (`Cache.tokens`, `Cache.lengths`), for a method with `lookup`."""
  if method.speculation.width == 1:
    return first_input(method, nxt_B)
  hit = inp_BW[:, 1:] == nxt_B[:, None]                                      # [B, C]
  row = 1 + jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), 0)
  src = jnp.take_along_axis(logits_BWV, row[:, None, None], axis=1)[:, 0]   # [B, V]
  return first_input(method, nxt_B, guesses(method, src, lookup_guess(method, tokens_BS, lengths_B, nxt_B)))


def speculation(method: CacheConfig, inp_BW, nxt_B, active_B):
  """(hits [] float32, steps [] float32, missed [B] bool) of this step's speculative tokens (a hit: one of the
  guesses was the sampled token); zeros for a one-row method. A row that is not active counts as neither."""
  if method.speculation.width == 1:
    zero = jnp.zeros((), jnp.float32)
    return zero, zero, jnp.zeros(nxt_B.shape, bool)
  missed = ~jnp.any(inp_BW[:, 1:] == nxt_B[:, None], axis=-1)
  return (jnp.sum(~missed & active_B).astype(jnp.float32), jnp.sum(active_B).astype(jnp.float32), missed)


def input_anchors(method: CacheConfig, tokens_BS, lengths_B, inp_BW):
  """Where the rows of the next input [B, W] copy from (`history.anchors`, [B, width] int32: a first input
  [B, 1] gets `history.NONE` for its candidates), or None for a method without `anchor_rows`."""
  if not method.speculation.anchor_rows:
    return None
  spec = method.speculation
  at_BW = history.anchors(tokens_BS, lengths_B, inp_BW, spec.lookup, min_match=spec.anchor_min_match)
  pad = spec.width - at_BW.shape[1]
  return jnp.pad(at_BW, ((0, 0), (0, pad)), constant_values=history.NONE) if pad else at_BW


def observation(method: CacheConfig, missed_B, tokens_BS, lengths_B, inp_BW):
  """What a speculative method's `Speculation.observe` hook is told before the input rows inp_BW [B, W] are
  decoded: the rows whose guesses of inp's real token all missed ([B] bool, or None) and, with `anchor_rows`,
  where inp's rows copy from (`input_anchors`, from the ids stored before them; else None). None for a one-row
  method (nothing to tell)."""
  if method.speculation.width == 1:
    return None
  return missed_B, input_anchors(method, tokens_BS, lengths_B, inp_BW)


def predecode_observation(method: CacheConfig, first_B, tokens_BS, lengths_B):
  """Before the pre-decoding pass, with `anchor_rows`: κ_1 is T1's, so T1's own anchor; else None."""
  if not method.speculation.anchor_rows:
    return None
  return observation(method, jnp.zeros(first_B.shape, bool), tokens_BS, lengths_B, first_B[:, None])


def observed(method: CacheConfig, cache: Cache, obs) -> Cache:
  """The cache after the method's hook saw `obs` (`observation`; None: unchanged)."""
  return cache if obs is None else cache.replace(layers=_observe(method, cache.layers, *obs))


def observe_speculation(method: CacheConfig, cache: Cache, missed_B, inp_BW=None) -> Cache:
  """Tell a speculative method which rows' guesses all missed and, with `anchor_rows`, where the next input's
  rows [B, W] copy from (`Speculation.observe`)."""
  if inp_BW is None:
    return cache.replace(layers=_observe(method, cache.layers, missed_B, None))
  return observed(method, cache, observation(method, missed_B, cache.tokens, cache.lengths, inp_BW))


def init_cache(method: CacheConfig, cfg: ModelConfig, batch: int, max_len: int, dtype) -> Cache:
  layers = method.impl.init(method, cfg, batch, max_len, dtype)
  tokens = history.empty(batch, method.slots(max_len)) if method.speculation.keeps_tokens else None
  return Cache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32), tokens=tokens)


def prefill(params, cfg: ModelConfig, method: CacheConfig, tokens_BT, lengths_B, cache: Cache):
  """The prompt through the cache -> (logits at each row's last prompt token [B, V] float32, cache)."""
  logits, cache, _ = decoder.forward(params, cfg, tokens_BT, cache, method, "prefill", prompt_lengths=lengths_B,
                                     logits_at=lengths_B - 1)
  return logits[:, 0], cache


def first_token(logits_BV, rng, spec: SamplingSpec):
  """The first generated token from the prefill's logits -> (first [B] int32, the rng to go on with)."""
  rng, sub = jax.random.split(rng)
  return sample(logits_BV, sub, spec), rng


def start_input(method: CacheConfig, first_B, logits_BV=None, tokens_BS=None, lengths_B=None):
  """The first decoding input [B, W]: T1 and, after a pre-decoding pass whose logits are logits_BV [B, V], its
  guesses of T2 (with a looked-up one where the method has lookup: the cache's ids and lengths). Without that
  pass (logits_BV None) a speculative method's guesses are placeholders, T1 repeated (SpeCache's
  `predecode=False`: κ_2 is their top-k; they count as guesses in the speculation's hit rate)."""
  if logits_BV is None:
    placeholders_BC = jnp.repeat(first_B[:, None], method.speculation.width - 1, axis=1)
    return first_input(method, first_B, placeholders_BC)
  return first_input(method, first_B, guesses(method, logits_BV, lookup_guess(method, tokens_BS, lengths_B, first_B)))


def start(params, cfg: ModelConfig, method: CacheConfig, first_B, cache: Cache):
  """After the first token: SpeCache's pre-decoding pass (over the low-bit copy; picks and fetches κ1) and its
  guess of token 2 (without the pass, `start_input`'s placeholders; the cache's κ stays empty for step 1).
  Returns (first decoding input [B, W], cache, pre-decoding logits [B, V] or None)."""
  if not method.speculation.predecodes:
    return start_input(method, first_B), cache, None
  cache = observed(method, cache, predecode_observation(method, first_B, cache.tokens, cache.lengths))
  logits, cache, _ = decoder.forward(params, cfg, first_B[:, None], cache, method, "predecode")
  inp = start_input(method, first_B, logits[:, 0], cache.tokens, cache.lengths)
  if method.speculation.anchor_rows:                                          # step 1's rows (κ_2 is the candidates')
    cache = observe_speculation(method, cache, jnp.zeros(first_B.shape, bool), inp)
  return inp, cache, logits[:, 0]


def begin_state(method: CacheConfig, cache: Cache, first_B, inp_BW, rng, spec: SamplingSpec, max_new_tokens: int,
                step_aux, record=None) -> DecodeState:
  """The state before decoding step 1: T1 in the output, no statistics yet. step_aux: a decoding step's aux
  (shapes suffice), leaves [L, B], whose sums over rows the state carries."""
  b = first_B.shape[0]
  return DecodeState(
      step=jnp.int32(1), cache=cache, inp=inp_BW,
      tokens=jnp.full((b, max_new_tokens), spec.pad_id, jnp.int32).at[:, 0].set(first_B),
      done=is_stop(first_B, spec), num_tokens=jnp.ones((b,), jnp.int32), rng=rng,
      stats=jax.tree.map(lambda s: jnp.zeros(s.shape[:1], jnp.float32), step_aux),
      spec_hits=jnp.zeros((), jnp.float32), spec_steps=jnp.zeros((), jnp.float32),
      missed=jnp.zeros((b,), bool), record=guards.empty_record() if record is None else record)


def _masked_sum(aux, active_B):
  """aux leaves [L, B] -> [L] summed over the active rows."""
  w = active_B.astype(jnp.float32)
  return jax.tree.map(lambda a: jnp.einsum("lb,b->l", a.astype(jnp.float32), w), aux)


def finish_step(method: CacheConfig, state: DecodeState, cache: Cache, logits_BWV, aux, spec: SamplingSpec
                ) -> DecodeState:
  """The tail of a decoding step, once the input rows went through the layers: sample the next token (the pad
  id for a row already done), stop tokens, the next input, the speculation outcome, the method's statistics
  summed over the active rows. cache: after the step (its ids and lengths feed `next_input`'s lookup; the offload
  runtime's has no layers); logits [B, W, V]; aux leaves [L, B]."""
  active = ~state.done
  rng, sub = jax.random.split(state.rng)
  nxt = jnp.where(state.done, spec.pad_id, sample(logits_BWV[:, 0], sub, spec))
  hits, steps, missed = speculation(method, state.inp, nxt, active)
  return state.replace(
      step=state.step + 1, cache=cache, inp=next_input(method, state.inp, nxt, logits_BWV, cache.tokens,
                                                        cache.lengths),
      tokens=jax.lax.dynamic_update_slice(state.tokens, nxt[:, None], (0, state.step)),
      done=state.done | is_stop(nxt, spec), num_tokens=state.num_tokens + active.astype(jnp.int32), rng=rng,
      stats=jax.tree.map(jnp.add, state.stats, _masked_sum(aux, active)),
      spec_hits=state.spec_hits + hits, spec_steps=state.spec_steps + steps, missed=missed)


def decode_step(params, cfg: ModelConfig, method: CacheConfig, state: DecodeState, spec: SamplingSpec,
                pin=lambda c: c, check_numerics: bool = False) -> DecodeState:
  """One step of the protocol: tell the method the last step's outcome, decode the input rows, `finish_step`."""
  cache = observed(method, state.cache, observation(method, state.missed, state.cache.tokens, state.cache.lengths,
                                                    state.inp))
  logits, cache, aux = decoder.forward(params, cfg, state.inp, cache, method, "decode")
  cache = pin(cache)
  if check_numerics:
    state = state.replace(record=guards.update(state.record, state.step, "decode", logits, cache.layers))
  return finish_step(method, state, cache, logits, aux, spec)


def output(state: DecodeState, check_numerics: bool = False) -> GenerateOutput:
  """The generation the state holds (with check_numerics, guards' record in stats[guards.RECORD_KEY])."""
  stats = dict(state.stats, spec_token_hits=state.spec_hits, spec_token_steps=state.spec_steps)
  if check_numerics:
    stats[guards.RECORD_KEY] = state.record
  return GenerateOutput(tokens=state.tokens, num_tokens=state.num_tokens, stats=stats)


def _pin(mesh):
  return (lambda c: sharding.constrain_cache(c, mesh)) if mesh is not None else (lambda c: c)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_new_tokens", "max_len", "mesh",
                                             "check_numerics"))
def start_jit(params, tokens_BT, lengths_B, rng, spec: SamplingSpec, *, cfg: ModelConfig, method: CacheConfig,
              max_new_tokens: int, max_len: int, mesh=None, check_numerics: bool = False) -> DecodeState:
  """The first program: prefill, the first token, `start` -> the state before decoding step 1 (per-layer cache).
  max_new_tokens: the output buffer's width (`loop_jit` may stop before it fills).
  mesh: a ("data", "model") Mesh to lay the cache out on (sharding.py; params arrive already sharded).
  check_numerics: carry guards' first-non-finite record."""
  b = tokens_BT.shape[0]
  pin = _pin(mesh)
  # The prompt and the pre-decoding pass: the stacked layer scan (one compiled layer: SmolLM2 SpeCache 1-bit's
  # start program compiles in ~3 s instead of ~6.5 s unrolled, for ~4% of a 1k-token prefill and one stacked ->
  # per-layer copy of the cache). Decoding steps: one buffer per layer, updated in place in the loop.
  layer_params = decoder.unstack_params(params, cfg.n_layers)
  cache = pin(init_cache(method, cfg, b, max_len, params["embed"].dtype))
  record = guards.empty_record()
  logits, cache = prefill(params, cfg, method, tokens_BT, lengths_B, cache)
  cache = pin(cache)
  if check_numerics:
    record = guards.update(record, 0, "prefill", logits, cache.layers)
  first, rng = first_token(logits, rng, spec)
  inp, cache, logits_p = start(params, cfg, method, first, cache)
  cache = pin(cache)
  if check_numerics and logits_p is not None:
    record = guards.update(record, 1, "predecode", logits_p, cache.layers)
  cache = decoder.per_layer(cache, cfg.n_layers)
  step_aux = jax.eval_shape(
      lambda c, i: decoder.forward(layer_params, cfg, i, c, method, "decode")[2], cache, inp)
  return begin_state(method, cache, first, inp, rng, spec, max_new_tokens, step_aux, record)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "mesh", "check_numerics"), donate_argnames=("state",))
def loop_jit(params, state: DecodeState, spec: SamplingSpec, new_tokens=None, *, cfg: ModelConfig,
             method: CacheConfig, mesh=None, check_numerics: bool = False) -> DecodeState:
  """The second program: decoding steps until `new_tokens` (a traced int32 scalar: a new count compiles
  nothing; None: the output's width) are out or every row is done. The state is donated and returned (the cache
  too, so that XLA aliases it: the loop updates it in place, with no copy on entry)."""
  layer_params = decoder.unstack_params(params, cfg.n_layers)
  pin = _pin(mesh)
  width = state.tokens.shape[1]
  limit = width if new_tokens is None else jnp.minimum(jnp.asarray(new_tokens, jnp.int32), width)
  return jax.lax.while_loop(
      lambda s: (s.step < limit) & ~jnp.all(s.done),
      lambda s: decode_step(layer_params, cfg, method, s, spec, pin, check_numerics), state)


def generate_jit(params, tokens_BT, lengths_B, rng, spec: SamplingSpec, *, cfg: ModelConfig, method: CacheConfig,
                 max_new_tokens: int, max_len: int, mesh=None, check_numerics: bool = False,
                 clock=None, out_width: int | None = None) -> GenerateOutput:
  """The jitted path: `start_jit` then `loop_jit`. clock: a `clock.CallClock` to mark the first token (the
  one wait between the programs; None: no wait). check_numerics: guards' record as stats[guards.RECORD_KEY].
  out_width: the output buffer's width (>= max_new_tokens; `buckets.plan`), which the programs are compiled
  for; `max_new_tokens` is a traced loop bound. The output's tokens are [B, out_width], pad_id past
  max_new_tokens."""
  kw = dict(cfg=cfg, method=method, mesh=mesh, check_numerics=check_numerics)
  width = max_new_tokens if out_width is None else out_width
  if width < max_new_tokens:
    raise ValueError(f"{out_width=} must be >= {max_new_tokens=}")
  state = start_jit(params, tokens_BT, lengths_B, rng, spec, max_new_tokens=width, max_len=max_len, **kw)
  if clock is not None:
    clock.first_token(state.tokens)
  return output(loop_jit(params, state, spec, jnp.int32(max_new_tokens), **kw), check_numerics)


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_len", "mesh"))
def prefill_cache(params, tokens_BT, lengths_B, *, cfg: ModelConfig, method: CacheConfig, max_len: int,
                  mesh=None) -> Cache:
  """The cache after the prompt, laid out (on `mesh`, if given) as `start_jit` lays it out."""
  pin = _pin(mesh)
  cache = pin(init_cache(method, cfg, tokens_BT.shape[0], max_len, params["embed"].dtype))
  return pin(prefill(params, cfg, method, tokens_BT, lengths_B, cache)[1])


def summarize_stats(stats: dict[str, Any]) -> dict[str, float]:
  """Turn summed counters into rates: exact speculative-token hit rate, the mean top-k hit rate, and the share
  of (layer, KV head) fetches made on the critical path (sync_fetch_rate)."""
  res = {}
  steps = float(stats.get("spec_token_steps", 0.0))
  if steps:
    res["exact_hit_rate"] = float(stats["spec_token_hits"]) / steps
  if "topk_hits" in stats and "topk_count" in stats:
    count = np.asarray(stats["topk_count"])
    misses = np.asarray(stats.get("miss_count", np.zeros_like(count)))
    for key in ("topk_hits", "unfetched_mass", "drift"):        # split by the speculative token's hit/miss
      if key not in stats:
        continue
      name = "topk_hit_rate" if key == "topk_hits" else key
      total, on_miss = np.asarray(stats[key]), np.asarray(stats[f"{key}_on_miss"])
      res[f"{name}_per_layer"] = [float(x) for x in total / np.maximum(count, 1.0)]
      res[name] = float(np.sum(total) / max(float(np.sum(count)), 1.0))
      for part, value, n in (("on_miss", on_miss, misses), ("on_hit", total - on_miss, count - misses)):
        if steps and np.sum(n) > 0:            # no such steps, or no speculative token at all: no entry
          res[f"{name}_{part}_per_layer"] = [float(x) for x in value / np.maximum(n, 1.0)]
          res[f"{name}_{part}"] = float(np.sum(value) / float(np.sum(n)))
  if "sync_fetch_heads" in stats and "sync_fetch_count" in stats:   # SpeCache fetches on the critical path
    heads, count = np.asarray(stats["sync_fetch_heads"]), np.asarray(stats["sync_fetch_count"])
    res["sync_fetch_rate"] = float(np.sum(heads) / max(float(np.sum(count)), 1.0))
    res["sync_fetch_rate_per_layer"] = [float(x) for x in heads / np.maximum(count, 1.0)]
  return res
