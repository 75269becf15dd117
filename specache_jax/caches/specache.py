"""SpeCache: a low-bit copy of the whole cache on the device, the complete 16-bit cache in (simulated) host
memory, top-k 16-bit rows per KV head fetched every step, picked by a speculative second token.

Decoding step t (per layer), input rows [T_t, T'_{t+1}] at positions n, n+1 (n = tokens stored):
  columns: every stored position once — the fetched rows κ_t and the residual window in 16-bit, the rest
  low-bit — plus the two new rows (the real row cannot see the speculative one: causal order).
  κ_{t+1} = top-k of the speculative row's probabilities averaged over each GQA group, candidates 0..n (the
  speculation value changes this: caches/speculation.py, docs/speculation.md).
  Only the real row's K/V is stored. Pre-decoding (`predecode`) runs T1 over the low-bit copy alone and
  picks κ_1 (the `predecode=False` ablation skips it: step 1 has no κ_1). `speculative=False` is the ablation
  that picks κ_t from the real row's own low-bit attention.

Simulated mode (`offload=False`): `k16/v16` are device arrays that attention reads ONLY through the gather at
κ (`fetch_simulated`). Offloaded mode (`offload=True`): they are absent ([B,K,0,H]); the runtime keeps them in
host memory, reads `kappa` (and, when a ring fills, the ring's R rows) from the state and writes
`fetched_k/fetched_v` back.
Axis letters as in caches/attention.py; X = k fetched rows.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specache_jax import dispatch, history, quant
from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches import selection
from specache_jax.caches import lowbit
from specache_jax.caches.hit_stats import hit_stats
from specache_jax.caches.base import HOST_STORES, CacheConfig, check_int, stack_layers  # noqa: F401
from specache_jax.caches.specache_attention import mixed_attention
from specache_jax.caches.speculation import FAITHFUL, FIELDS, SpeCacheSpeculation, robust
from specache_jax.errors import ConfigError

ONE_BIT_RULES = ("specache", "kivi")             # quant.py's 1-bit rules: SpeCache's levels, or KIVI's (ablation)
ROBUST_TOPK = 128

# Options that measured worse than what the presets use and were removed (docs/speculation.md has the numbers).
REMOVED = {
    "hedge": "part of κ from the real row's top-k",
    "hedge_shift": "the hedged rows moved one position on",
    "drift": "κ_t refetched for heads whose query drifted",
    "candidate_merge": "candidates merged by their mean probability",
    "score_levels": "1-bit keys scored at KIVI's levels",
}


def _robust(settings: dict) -> dict:
  """The best combination measured (docs/speculation.md; SmolLM2-135M, 1-bit): κ of k = 128 rows (device bytes
  0.118x the full cache's at 8k, bf16) with `speculation.robust(k)`."""
  topk = settings.get("topk", ROBUST_TOPK)
  return dict(topk=topk, speculation=robust(topk))


# Named settings (`cache_config("specache", preset=...)`), each a function of the settings given (which win).
PRESETS = {
    "faithful": lambda settings: {},      # the paper's method (the defaults)
    "robust": _robust,
}


@dataclasses.dataclass(frozen=True)
class SpeCacheConfig(CacheConfig):
  name = "specache"
  bits: int = 2                 # low-bit copy: 1, 2 (paper), 4, 8 (ablations)
  group_size: int = 64          # g
  residual: int = 64            # R, 16-bit recent tokens on the device (g | R)
  topk: int = 64                # k rows fetched per layer per KV head per step
  one_bit: str = "specache"     # 1-bit rule: "specache" (levels m+(M-m)/4, m+3(M-m)/4) or "kivi" (ablation: m, M)
  offload: bool = False         # True: the 16-bit cache lives in host memory (runtime.py)
  host_store: str = "auto"      # offloaded store: auto | pinned_host | numpy (offload.py)
  attention_impl: str = "auto"  # the kernel family (specache_jax.dispatch.IMPLS): auto (the platform's) | jnp |
                                # cpu | pallas | pallas_tpu | pallas_interpret | pallas_tpu_interpret
  track_hits: bool = False      # also compute the real query's exact top-k over 16-bit keys (hit rates)
  speculation: SpeCacheSpeculation = FAITHFUL   # how κ is chosen (caches/speculation.py)

  def __post_init__(self):
    if self.bits not in quant.BITS:
      raise ConfigError(f"bits={self.bits!r} must be one of {quant.BITS}")
    check_int("group_size", self.group_size, 1)
    check_int("residual", self.residual, 1)
    check_int("topk", self.topk, 0)
    if self.residual % self.group_size:
      raise ConfigError(f"group_size={self.group_size} must divide residual={self.residual} "
                        "(keys are quantized a whole residual window at a time)")
    if self.one_bit not in ONE_BIT_RULES:
      raise ConfigError(f"one_bit={self.one_bit!r} must be one of {ONE_BIT_RULES}"
                        + (" (one_bit='mean' was removed: docs/speculation.md)" if self.one_bit == "mean" else ""))
    if self.host_store not in HOST_STORES:
      raise ConfigError(f"host_store={self.host_store!r} must be one of {HOST_STORES}")
    dispatch.check_impl(self.attention_impl)
    if not isinstance(self.track_hits, bool):
      raise ConfigError(f"track_hits={self.track_hits!r} must be a bool")
    spec = self.speculation
    if not isinstance(spec, SpeCacheSpeculation):
      raise ConfigError(f"speculation={spec!r} must be a SpeCacheSpeculation")
    if spec.lookup_rows > self.topk:
      raise ConfigError(f"lookup_rows={spec.lookup_rows} must be at most topk={self.topk} (a share of the k rows)")

  @property
  def impl(self):
    return sys.modules[__name__]

  @classmethod
  def resolve_settings(cls, preset: str | None, settings: dict) -> dict:
    """`cache_config("specache", ...)`'s settings -> this class's fields: PRESETS[preset] under the given
    settings (which win), and SpeCacheSpeculation's fields given flat (`exact_on_miss=True`) put into the
    `speculation` value (on top of a given or preset one). A removed option is refused, by name."""
    removed = sorted(set(settings) & set(REMOVED))
    if removed:
      raise ConfigError("; ".join(f"{k}={settings[k]!r}: the option {k!r} ({REMOVED[k]}) was removed: it measured "
                                  "worse than the robust preset (docs/speculation.md)" for k in removed))
    if preset is not None:
      if preset not in PRESETS:
        raise ConfigError(f"preset={preset!r} is not a SpeCache preset; expected one of {tuple(PRESETS)}")
      settings = {**PRESETS[preset](settings), **settings}
    flat = {k: settings.pop(k) for k in FIELDS if k in settings}
    if flat:
      base = settings.get("speculation", FAITHFUL)
      if not isinstance(base, SpeCacheSpeculation):
        raise ConfigError(f"speculation={base!r} must be a SpeCacheSpeculation")
      settings["speculation"] = dataclasses.replace(base, **flat)
    return settings

  def flat_settings(self) -> dict:
    """The settings with the speculation's fields flat (JSON-ready; `resolve_settings` reads them back)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "speculation"}
    return {**out, **dataclasses.asdict(self.speculation)}

  def slots(self, max_len):
    return lowbit.round_slots(max_len, self.residual)

  def sixteen_bit_from(self, n_B):
    """[B]: the first position an attend after n_B stored tokens reads with 16-bit keys, the ring's (by KIVI's
    rule past its last quantized window; with exact_ring all of it): `lowbit.sixteen_bit_from`."""
    return lowbit.sixteen_bit_from(n_B, self.residual, self.speculation.exact_ring)

  def validate(self, model_cfg, max_len):
    try:
      quant.validate(self.bits, self.group_size, model_cfg.head_dim, self.residual)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    dispatch.check_layout(self.attention_impl, self.bits, self.group_size, model_cfg.head_dim)
    if self.topk > self.slots(max_len):
      raise ConfigError(f"topk={self.topk} is larger than the cache ({self.slots(max_len)} slots for "
                        f"max_len={max_len})")

  @property
  def qargs(self):
    return dict(bits=self.bits, group_size=self.group_size, residual=self.residual, one_bit=self.one_bit)


@struct.dataclass
class State:
  low: lowbit.LowBit       # the low-bit copy + 16-bit residual ring (device)
  k16: jax.Array           # [B, K, S, H] complete 16-bit keys ("host"; [B, K, 0, H] when offloaded)
  v16: jax.Array           # [B, K, S, H]
  kappa: jax.Array         # [B, K, X] int32 positions to use in 16-bit at the next attend (-1: none; so until
                           # the first fetch: a step 1 without pre-decoding attends no κ_1)
  fetched_k: jax.Array     # [B, K, X, H] the 16-bit rows at kappa (device)
  fetched_v: jax.Array     # [B, K, X, H]
  miss: jax.Array          # [B] bool: every speculative guess of this step's real token was wrong
  spec_q: jax.Array        # [B, K, C·G, H] float32 the queries that chose κ, candidate-major (track_hits'
                           # drift statistic; else [B, K, C·G, 0])
  anchor: jax.Array        # [B, W] int32 where the next input's rows copy from (lookup_rows; else [B, 0]):
                           # column 0 for the real row's own κ choice, 1.. for the candidates' κ_{t+1}


def init(method: SpeCacheConfig, model_cfg, batch, max_len, dtype) -> State:
  method.validate(model_cfg, max_len)
  s, k, h, x = method.slots(max_len), model_cfg.n_kv_heads, model_cfg.head_dim, method.topk
  spec = method.speculation
  host = (batch, k, 0 if method.offload else s, h)
  st = State(
      low=lowbit.init(batch, k, s, h, method.bits, method.group_size, method.residual, dtype),
      k16=jnp.zeros(host, dtype), v16=jnp.zeros(host, dtype),
      kappa=jnp.full((batch, k, x), -1, jnp.int32),
      fetched_k=jnp.zeros((batch, k, x, h), dtype), fetched_v=jnp.zeros((batch, k, x, h), dtype),
      miss=jnp.zeros((batch,), bool),
      spec_q=jnp.zeros((batch, k, spec.candidates * (model_cfg.n_heads // k),
                        h if _keeps_spec_query(method) else 0), jnp.float32),
      anchor=jnp.full((batch, spec.width if spec.lookup_rows else 0), history.NONE, jnp.int32))
  return stack_layers(model_cfg.n_layers, st)


def _keeps_spec_query(method: SpeCacheConfig) -> bool:
  """track_hits (simulated) reports how far the real query drifted from the one that chose κ."""
  return method.track_hits and not method.offload and method.speculation.speculative


def prefill(method: SpeCacheConfig, st: State, k, v, lengths, colsum=None) -> State:
  del colsum
  k_BKTH, v_BKTH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  st = st.replace(low=lowbit.prefill(st.low, k_BKTH, v_BKTH, lengths, **method.qargs))
  if not method.offload:
    zero = jnp.zeros_like(lengths)
    st = st.replace(k16=A.write_rows(st.k16, k_BKTH, zero), v16=A.write_rows(st.v16, v_BKTH, zero))
  return st


def with_fetched(method: SpeCacheConfig, st: State, kappa_BKX, k_rows_BKXH, v_rows_BKXH) -> State:
  """The one writer of κ and its fetched 16-bit rows (the simulated gather and the host store both end here)."""
  del method
  return st.replace(kappa=kappa_BKX, fetched_k=k_rows_BKXH.astype(st.fetched_k.dtype),
                    fetched_v=v_rows_BKXH.astype(st.fetched_v.dtype))


def fetch_simulated(st: State, kappa_BKX) -> State:
  """The simulated transfer: the only read of the 16-bit cache, a gather at κ."""
  return with_fetched(None, st, kappa_BKX, A.gather_rows(st.k16, kappa_BKX), A.gather_rows(st.v16, kappa_BKX))


def _fetch(method: SpeCacheConfig, st: State, kappa_BKX) -> State:
  """Simulated: gather the rows now. Offloaded: only record κ; the runtime's host store supplies the rows
  (`with_fetched`) before the next attend. The one place the two paths differ."""
  return st.replace(kappa=kappa_BKX) if method.offload else fetch_simulated(st, kappa_BKX)


def store(method: SpeCacheConfig, st: State, k_BKH, v_BKH, lengths) -> State:
  """Store the real row, all but the ring (written after the attention: `lowbit.store_ring`): quantized on the
  device, 16-bit to the (simulated) host."""
  k, v = k_BKH[:, :, None], v_BKH[:, :, None]
  sixteen = () if method.offload else ((st.k16, k), (st.v16, v))     # in the same conditional as the codes
  low, sixteen = lowbit.store_codes(st.low, k, v, lengths, **method.qargs, also=sixteen)
  return st.replace(low=low, **dict(zip(("k16", "v16"), sixteen)))


def fetches_on_critical_path(method: SpeCacheConfig) -> bool:
  """Whether a step may choose (and so fetch) its own κ_t before attention (`SpeCacheSpeculation`)."""
  return method.speculation.fetches_on_critical_path


# ----- the offloaded runtime's hooks (`base.OffloadModule`; with_fetched, kappa_for_step above and below) -----

def prefetches(method: SpeCacheConfig) -> bool:
  """A speculative step ends with κ_{t+1} chosen (`attend`): it is fetched while the later layers run."""
  return method.speculation.speculative


def next_index(method: SpeCacheConfig, st: State):
  return st.kappa


def flushes(method: SpeCacheConfig, stored_B: np.ndarray):
  """The rows whose residual ring has just filled (every R steps): its R rows, from stored - R. The host only
  ever serves κ rows below the ring's 16-bit keys: exactly the flushed rows."""
  return np.flatnonzero(stored_B % method.residual == 0), stored_B - method.residual


def flushed_rows(method: SpeCacheConfig, st: State, start_B):
  del method, start_B
  return st.low.ring_k, st.low.ring_v


def corrected_heads(method: SpeCacheConfig, st: State):
  """[B, K] bool: the KV heads whose κ_t is chosen now from the real row (non-speculative: all; exact_on_miss:
  every head of a row whose guesses all missed)."""
  b, n_kv = st.kappa.shape[:2]
  if not method.speculation.speculative:
    return jnp.ones((b, n_kv), bool)
  if method.speculation.exact_on_miss:
    return jnp.broadcast_to(st.miss[:, None], (b, n_kv))
  return jnp.zeros((b, n_kv), bool)


def kappa_for_step(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """κ_t for this step's attention, chosen now from the real row (step 1 of a SpeCache step): the real row's own
  low-bit top-k for the `corrected_heads`, the prefetched κ_t for the others. Only called when
  `fetches_on_critical_path(method)`."""
  real = choose_nonspeculative(method, st, q[:, :1], k_new[:, :1], v_new[:, :1], lengths)
  return jnp.where(corrected_heads(method, st)[..., None], real, st.kappa)


def _fetched_for_step(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths) -> State:
  """Simulated: κ_t chosen now (`kappa_for_step`) and gathered, only where some head of the batch is corrected
  (a lax.cond; else the prefetched rows stand, which the choice would keep: exact_on_miss skips the real row's
  scoring pass on a step whose guesses all hit). Only the small κ arrays pass through the cond."""
  def now():
    got = fetch_simulated(st, kappa_for_step(method, st, q, k_new, v_new, lengths))
    return got.kappa, got.fetched_k, got.fetched_v

  if not method.speculation.speculative:             # every head, every step
    kappa, fetched_k, fetched_v = now()
  else:
    kappa, fetched_k, fetched_v = jax.lax.cond(jnp.any(corrected_heads(method, st)), now,
                                               lambda: (st.kappa, st.fetched_k, st.fetched_v))
  return st.replace(kappa=kappa, fetched_k=fetched_k, fetched_v=fetched_v)


def _probability_rows(method: SpeCacheConfig) -> tuple[int, ...]:
  """The decoding rows whose probabilities κ_{t+1} is chosen from: the speculative candidates' (a single
  candidate as row -1: the form the fused kernels return)."""
  c = method.speculation.candidates
  return (-1,) if c == 1 else tuple(range(1, 1 + c))


def _anchored(method: SpeCacheConfig, st: State, probs: selection.Scores, real: bool, n_B) -> selection.Scores:
  """With lookup_rows: the scores with the anchor windows of the real row (its own κ choice) or of the
  speculative candidates (κ_{t+1}) raised above every probability (`selection.anchored`), for an attend after
  n_B stored tokens (below its ring)."""
  spec = method.speculation
  if not spec.lookup_rows:
    return probs
  low_below = method.sixteen_bit_from(n_B)
  return selection.anchored(probs, st.anchor[:, :1] if real else st.anchor[:, 1:], spec.lookup_rows, low_below)


def _next_kappa(method: SpeCacheConfig, st: State, probs_BKRS: selection.Scores, lengths):
  """κ_{t+1} from this step's probabilities (rows: `_probability_rows`, several candidates' merged by their
  largest; with lookup_rows, the candidates' anchors first); candidates: `selection.candidates(method, n + 1)`
  (0..n, T_t included; with skip_ring only those below the ring)."""
  probs_BKRS = _anchored(method, st, probs_BKRS, real=False, n_B=lengths + 1)
  if method.speculation.candidates == 1:
    return selection.select_row(method, probs_BKRS, -1, lengths + 1)
  return selection.select(method, jnp.max(probs_BKRS.dense(), axis=2), lengths + 1)


def attend_fetched(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """Steps 2-3 of a SpeCache step, given the fetched rows of κ_t in the state and the real row's codes already
  stored (the ring still without it): attend (16-bit at κ_t and the ring, low-bit elsewhere) and select
  κ_{t+1} (`_next_kappa`: the speculative rows' top-k; recorded in `st.kappa`, fetched by the caller).
  -> (out [B,T,N,H], st, aux)

  aux: sync_fetch_heads [B], the fraction of KV heads whose κ_t was fetched on the critical path, with its
  counter sync_fetch_count (methods that may fetch so), and the top-k hit counters with track_hits."""
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)            # [B, K, T, H]
  aux = {}
  if fetches_on_critical_path(method):
    aux["sync_fetch_heads"] = jnp.mean(corrected_heads(method, st).astype(jnp.float32), axis=1)
    aux["sync_fetch_count"] = jnp.ones(lengths.shape, jnp.float32)
  aux.update(hit_stats(method, st, q, lengths, st.kappa))
  out, probs = mixed_attention(method, st, q, kn, vn, lengths, use_kappa=True,
                               rows=_probability_rows(method))
  if method.speculation.speculative:
    st = _with_spec_query(method, st.replace(kappa=_next_kappa(method, st, probs, lengths)), q)
  return out, st, aux


def _with_spec_query(method: SpeCacheConfig, st: State, q):
  """Record the queries that chose κ (the speculative candidates' rows 1.., or T1 in pre-decoding, standing for
  every candidate) for track_hits' drift statistic. -> spec_q [B, K, C·G, H]."""
  if not _keeps_spec_query(method):
    return st
  rows = q[:, 1:] if q.shape[1] > 1 else jnp.repeat(q, method.speculation.candidates, axis=1)   # [B, C, N, H]
  split = A.split_heads(rows, st.kappa.shape[1]).astype(jnp.float32)                  # [B, C, K, G, H]
  b, c, k, g, h = split.shape
  return st.replace(spec_q=jnp.swapaxes(split, 1, 2).reshape(b, k, c * g, h))


def attend(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """One SpeCache decoding step for one layer: store the real row (device: low-bit; simulated: also the 16-bit
  copy), then (1) κ_t — prefetched, or chosen now on the critical path — (2) attend, (3) select κ_{t+1} and
  fetch it, and put the row in the ring. Offloaded, the runtime does the fetches of (1) and (3) with its host
  store; simulated, `_fetch` gathers on the device. Storing first lets every big buffer be updated in place:
  what this step reads of them (positions < lengths) is not what it writes; the ring, which the attention
  reads whole, is written after it (`lowbit.store_ring`)."""
  st = store(method, st, k_new[:, 0], v_new[:, 0], lengths)
  if fetches_on_critical_path(method) and not method.offload:
    st = _fetched_for_step(method, st, q, k_new, v_new, lengths)
  out, st, aux = attend_fetched(method, st, q, k_new, v_new, lengths)
  st = st.replace(low=lowbit.store_ring(st.low, k_new[:, 0, :, None], v_new[:, 0, :, None], lengths, after=out))
  if method.speculation.speculative:
    st = _fetch(method, st, st.kappa)
  return out, st, aux


def choose_nonspeculative(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """κ_t of the non-speculative ablation: top-k of the real row's low-bit attention over stored positions (with
  correct_with_fetched, the rows of st.kappa scored from their fetched 16-bit keys)."""
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)
  _, probs = mixed_attention(method, st, q, kn, vn, lengths, use_kappa=method.speculation.correct_with_fetched,
                             scores_only=True)
  return selection.select_row(method, _anchored(method, st, probs, real=True, n_B=lengths), -1, lengths)


def predecode(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """T1 over the low-bit copy (+ the 16-bit ring and its own row); picks κ_1 and fetches it; stores nothing."""
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)
  out, probs = mixed_attention(method, st, q, kn, vn, lengths, use_kappa=False)
  st = _with_spec_query(method, st, q)     # T1 is step 1's real row (the same query at layer 0; deeper layers
                                           # differ by the low-bit-only attention of this pass)
  kappa = selection.select_row(method, _anchored(method, st, probs, True, lengths), -1, lengths)   # stored: 0..L-1
  return out, _fetch(method, st, kappa), {}


def device_bytes(method, st: State) -> int:
  """Everything but the 16-bit cache (which belongs to host memory)."""
  return tree_nbytes(st) - tree_nbytes((st.k16, st.v16))


def host_bytes(method, st: State) -> int:
  return tree_nbytes((st.k16, st.v16))
