"""SpeCache: a low-bit copy of the whole cache on the device, the complete 16-bit cache in (simulated) host
memory, top-k 16-bit rows per KV head fetched every step, picked by a speculative second token.

Decoding step t (per layer), input rows [T_t, T'_{t+1}] at positions n, n+1 (n = tokens stored):
  columns: every stored position once — the fetched rows κ_t and the residual window in 16-bit, the rest
  low-bit — plus the two new rows (the real row cannot see the speculative one: causal order).
  κ_{t+1} = top-k of the speculative row's probabilities averaged over each GQA group, candidates 0..n (the
  robust options below change this: skip_ring drops the ring's positions, hedge takes some rows from the real
  row's probabilities, drift replaces a drifted head's κ_t by the real row's own top-k).
  Only the real row's K/V is stored. Pre-decoding (`predecode`) runs T1 over the low-bit copy alone and
  picks κ_1. `speculative=False` is the ablation that picks κ_t from the real row's own low-bit attention.

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
from flax import struct

from pallas_kernels import ATTENTION_IMPLS
from specache_jax import history, quant
from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches import selection
from specache_jax.caches import lowbit
from specache_jax.caches.hit_stats import hit_stats, query_drift
from specache_jax.caches.base import CacheConfig, check_int, stack_layers
from specache_jax.caches.specache_attention import mixed_attention
from specache_jax.errors import ConfigError

HOST_STORES = ("auto", "pinned_host", "numpy")   # offload.py: where the 16-bit cache lives when offloaded
CANDIDATE_MERGES = ("max", "mean")               # how several speculative rows' probabilities combine
SCORE_LEVELS = ("stored", "range")               # the key levels the low-bit copy scores with (score_levels)

# Named settings (`cache_config("specache", preset=...)`), each a function of the settings given (which win over
# it):
#   faithful  the paper's method: every robust-speculation option off (the defaults);
#   robust    the best combination measured (README, results/speculation: SmolLM2-135M, 1-bit): 3 speculative
#             candidates, exact_on_miss, correct_with_fetched, lowbit_in_output=False, prompt lookup (lookup=3: a
#             looked-up guess; lookup_rows: while the output repeats 3 tokens of the context, κ takes the rows
#             around where they occurred), κ of k = 128 rows (device bytes 0.118x the full cache's at 8k, bf16),
#             at most k/2 of them around anchors, so the scored rows keep at least 64, and the ring read with its
#             16-bit keys (exact_ring; κ outside it: skip_ring). Measured: 4k-8k perplexity 1.042x full, RULER 35.8
#             (full 36.2), NIAH 52 of the 54 cells full gets over 4 needles, no (layer, KV head) fetch on the
#             critical path in the hit-rate run (issue 14's bar: met). Its cost: 2 more query rows per step, a host
#             sync per step, 4 bytes per token of ids, twice the faithful method's rows moved per step; offloaded
#             at 4k: README. Earlier robust presets: the labels specache_1bit_robust_kiviring (before exact_ring),
#             specache_1bit_robust_k64, specache_1bit_cand3eom_fetched_scoreonly (before lookup) and
#             specache_1bit_skiphedgedrift.
ROBUST_TOPK = 128


def _robust(settings: dict) -> dict:
  topk = settings.get("topk", ROBUST_TOPK)
  return dict(candidates=3, exact_on_miss=True, correct_with_fetched=True, lowbit_in_output=False, lookup=3,
              topk=topk, lookup_rows=topk // 2, exact_ring=True, skip_ring=True)


PRESETS = {
    "faithful": lambda settings: {},
    "robust": _robust,
}


@dataclasses.dataclass(frozen=True)
class SpeCacheConfig(CacheConfig):
  name = "specache"
  bits: int = 2                 # low-bit copy: 1, 2 (paper), 4, 8 (ablations)
  group_size: int = 64          # g
  residual: int = 64            # R, 16-bit recent tokens on the device (g | R)
  topk: int = 64                # k rows fetched per layer per KV head per step
  one_bit: str = "specache"     # 1-bit rule: "specache" (levels m+(M-m)/4, m+3(M-m)/4), "kivi" (ablation) or
                                # "mean" (the means of each group's two halves split at its mean; lower error,
                                # ranks outlying keys lower: NIAH worse, README)
  speculative: bool = True      # False: κ_t from the real token's own low-bit attention, fetched synchronously
  offload: bool = False         # True: the 16-bit cache lives in host memory (runtime.py)
  host_store: str = "auto"      # offloaded store: auto | pinned_host | numpy (offload.py)
  track_hits: bool = False      # also compute the real query's exact top-k over 16-bit keys (hit rates)
  exact_on_miss: bool = False   # project extension: when the speculative token was wrong, fetch the real
                                # token's own top-k synchronously before attention (an "exact" fetch)
  attention_impl: str = "jnp"   # jnp (XLA:CPU: the CPU kernel where it applies) | pallas | pallas_interpret
                                # (pallas_kernels/mixed_decode_attention; cpu_kernels/mixed_attention)
  # Robust speculation (project extensions, each off by default and composable; the faithful method is the default):
  skip_ring: bool = False       # κ candidates exclude positions the attend that uses κ reads in 16-bit anyway (ring)
  hedge: int = 0                # of the k rows of κ_{t+1}, this many are the real row's top-k, the rest the
                                # speculative row's (same bytes moved; attention_impl "jnp": XLA or the CPU kernel)
  hedge_shift: int = 0          # the real row's picks are the positions this far after its top ones (1: where
                                # copying heads look next)
  drift: float = 0.0            # > 0: per layer, a KV head whose real query moved more than this (1 - cosine,
                                # mean over its query heads; with candidates, from the nearest candidate's) from
                                # the speculative query that chose κ_t gets the real row's own low-bit top-k
                                # instead, fetched on the critical path
  candidates: int = 1           # speculative rows per step: the `candidates` likeliest next tokens (the top
                                # guesses of the row whose guess was right), each at position n+1 beside the real
                                # row; κ_{t+1} is the top-k of their probabilities merged per position by
                                # `candidate_merge` (same bytes moved, more rows computed; attention_impl "jnp" for > 1)
  candidate_merge: str = "max"  # max | mean over the candidates' group-averaged probabilities
  lookup: int = 0               # > 0: the token that followed the latest earlier occurrence of the last `lookup`
                                # tokens (or a shorter suffix) in the prompt and output so far replaces the last
                                # guess where it is not one already (prompt lookup: copied text, cycles; history.py)
  lookup_rows: int = 0          # > 0 (needs lookup): up to this many of κ's rows are taken, before any scored row,
                                # around the anchors of the rows that will use κ (where each row's last 3 tokens
                                # occurred before, + 1: where a copying head reads; `history.anchors`): the nearest
                                # of a window of selection.ANCHOR_WINDOW each whose keys are low-bit. Same bytes
  anchor_match: int = 3         # the shortest repeat (tokens; `lookup` if that is shorter) that anchors a row:
                                # short ones ("in the") are everywhere in prose
  lowbit_in_output: bool = True  # False: a decoding step's output attends only κ_t's 16-bit rows, the ring (16-bit
                                # values; keys low-bit where already quantized) and the new rows: no low-bit value
                                # enters it, the low-bit copy only scores (κ_{t+1}; and the pre-decoding pass's T1,
                                # which has nothing else). Same bytes; the fused kernels still score every row
  correct_with_fetched: bool = False  # a synchronous κ_t choice (exact_on_miss, drift, non-speculative) scores the
                                # rows already on the device (the prefetched κ_t, or the last step's) in 16-bit and
                                # the rest low-bit, instead of every row low-bit. Same bytes
  exact_ring: bool = False      # the ring's columns read its 16-bit keys at every slot: by KIVI's rule (off) the
                                # slots of the last quantized window read their low-bit keys although the ring
                                # holds their 16-bit keys on the device (g = R: right after a flush, the last R
                                # tokens, e.g. a prompt's question); κ and the anchors then skip the whole ring.
                                # Same bytes
  score_levels: str = "stored"  # "range": where the low-bit copy only scores (lowbit_in_output=False; a synchronous
                                # κ_t choice), its 1-bit keys score at their groups' min/max (KIVI's levels, from
                                # the stored scale and zero: quant.range_levels) instead of the stored levels; the
                                # codes are the same. Same bytes. Measured (README): the needle ranks higher for the
                                # heads that retrieve it, every head's own top-k is hit less; NIAH worse

  def __post_init__(self):
    if self.bits not in quant.BITS:
      raise ConfigError(f"bits={self.bits!r} must be one of {quant.BITS}")
    check_int("group_size", self.group_size, 1)
    check_int("residual", self.residual, 1)
    check_int("topk", self.topk, 0)
    if self.residual % self.group_size:
      raise ConfigError(f"group_size={self.group_size} must divide residual={self.residual} "
                        "(keys are quantized a whole residual window at a time)")
    if self.one_bit not in quant.ONE_BIT_RULES:
      raise ConfigError(f"one_bit={self.one_bit!r} must be one of {quant.ONE_BIT_RULES}")
    if self.host_store not in HOST_STORES:
      raise ConfigError(f"host_store={self.host_store!r} must be one of {HOST_STORES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ConfigError(f"attention_impl={self.attention_impl!r} must be one of {ATTENTION_IMPLS}")
    check_int("hedge", self.hedge, 0)
    check_int("hedge_shift", self.hedge_shift, 0)
    if self.hedge > self.topk:
      raise ConfigError(f"hedge={self.hedge} must be at most topk={self.topk} (it is a share of the k rows)")
    if self.hedge_shift and not self.hedge:
      raise ConfigError(f"hedge_shift={self.hedge_shift} needs hedge > 0 (it moves the real row's picks)")
    if self.hedge and self.attention_impl != "jnp":
      raise ConfigError(f"hedge={self.hedge} needs attention_impl='jnp' (the Pallas kernel returns only the "
                        f"speculative row's probabilities), got {self.attention_impl!r}")
    if not isinstance(self.drift, (int, float)) or isinstance(self.drift, bool) or not 0.0 <= self.drift < 2.0:
      raise ConfigError(f"drift={self.drift!r} must be a number in [0, 2) (a cosine distance, at most 2: a "
                        "threshold of 2 never fires; 0 = off)")
    if (self.hedge or self.drift) and not self.speculative:
      raise ConfigError(f"hedge={self.hedge} / drift={self.drift} refine speculative selection; they need "
                        "speculative=True")
    check_int("candidates", self.candidates, 1)
    if self.candidates > 1 and not self.speculative:
      raise ConfigError(f"candidates={self.candidates} are speculative rows; they need speculative=True")
    if self.candidates > 1 and self.attention_impl != "jnp":
      raise ConfigError(f"candidates={self.candidates} needs attention_impl='jnp' (the Pallas kernel returns "
                        f"only the last row's probabilities), got {self.attention_impl!r}")
    check_int("lookup", self.lookup, 0)
    if self.lookup and not self.speculative:
      raise ConfigError(f"lookup={self.lookup} adds a speculative guess; it needs speculative=True")
    check_int("lookup_rows", self.lookup_rows, 0)
    if self.lookup_rows and not self.lookup:
      raise ConfigError(f"lookup_rows={self.lookup_rows} anchors κ where the tokens occurred before; it needs "
                        "lookup > 0 (the n-gram it matches)")
    check_int("anchor_match", self.anchor_match, 1)
    if self.lookup_rows > self.topk:
      raise ConfigError(f"lookup_rows={self.lookup_rows} must be at most topk={self.topk} (a share of the k rows)")
    if self.candidate_merge not in CANDIDATE_MERGES:
      raise ConfigError(f"candidate_merge={self.candidate_merge!r} must be one of {CANDIDATE_MERGES}")
    if not isinstance(self.lowbit_in_output, bool):
      raise ConfigError(f"lowbit_in_output={self.lowbit_in_output!r} must be a bool")
    if not isinstance(self.exact_ring, bool):
      raise ConfigError(f"exact_ring={self.exact_ring!r} must be a bool")
    if not isinstance(self.correct_with_fetched, bool):
      raise ConfigError(f"correct_with_fetched={self.correct_with_fetched!r} must be a bool")
    if self.score_levels not in SCORE_LEVELS:
      raise ConfigError(f"score_levels={self.score_levels!r} must be one of {SCORE_LEVELS}")
    if self.score_levels == "range" and self.lowbit_in_output:
      raise ConfigError("score_levels='range' scores with other key levels than an output over the low-bit copy "
                        "would use: it needs lowbit_in_output=False (the low-bit copy only scores)")
    if self.score_levels == "range" and self.one_bit not in ("specache", "kivi"):
      raise ConfigError(f"score_levels='range' needs a range 1-bit rule (one_bit 'specache' or 'kivi'), got "
                        f"one_bit={self.one_bit!r}")
    if self.correct_with_fetched and not fetches_on_critical_path(self):
      raise ConfigError("correct_with_fetched=True acts on synchronous κ choices: it needs exact_on_miss=True, "
                        "drift > 0 or speculative=False")

  @property
  def impl(self):
    return sys.modules[__name__]

  @classmethod
  def preset_settings(cls, preset: str, settings: dict) -> dict:
    """`cache_config("specache", preset=...)`: PRESETS[preset] under the given settings (which win)."""
    if preset not in PRESETS:
      raise ConfigError(f"preset={preset!r} is not a SpeCache preset; expected one of {tuple(PRESETS)}")
    return {**PRESETS[preset](settings), **settings}

  @property
  def lookup_ngram(self) -> int:
    return self.lookup

  @property
  def anchor_rows(self) -> int:
    return self.lookup_rows

  @property
  def anchor_min_match(self) -> int:
    return min(self.anchor_match, self.lookup)

  @property
  def decode_width(self) -> int:
    return 1 + self.candidates if self.speculative else 1

  def row_offsets(self, t):
    """The real row at n, every speculative candidate at n + 1."""
    return (0,) + (1,) * (t - 1)

  @property
  def uses_predecode(self) -> bool:
    return self.speculative

  def rows_stored(self, t, phase):
    return 1 if (phase == "decode" and self.speculative) else t

  def slots(self, max_len):
    return lowbit.round_slots(max_len, self.residual)

  def validate(self, model_cfg, max_len):
    try:
      quant.validate(self.bits, self.group_size, model_cfg.head_dim, self.residual)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if self.topk > self.slots(max_len):
      raise ConfigError(f"topk={self.topk} is larger than the cache ({self.slots(max_len)} slots for "
                        f"max_len={max_len})")
    if self.hedge_shift >= self.slots(max_len):
      raise ConfigError(f"hedge_shift={self.hedge_shift} must be below the cache's {self.slots(max_len)} slots "
                        f"(max_len={max_len}): every shifted pick would fall past the end")

  def observe_speculation(self, st, missed_B, anchors_BW=None):
    return observe_speculation(self, st, missed_B, anchors_BW)

  def host_bytes(self, st) -> int:
    if isinstance(st, (tuple, list)):
      return int(sum(host_bytes(self, s) for s in st))
    return host_bytes(self, st)

  @property
  def qargs(self):
    return dict(bits=self.bits, group_size=self.group_size, residual=self.residual, one_bit=self.one_bit)


@struct.dataclass
class State:
  low: lowbit.LowBit       # the low-bit copy + 16-bit residual ring (device)
  k16: jax.Array           # [B, K, S, H] complete 16-bit keys ("host"; [B, K, 0, H] when offloaded)
  v16: jax.Array           # [B, K, S, H]
  kappa: jax.Array         # [B, K, X] int32 positions to use in 16-bit at the next attend
  fetched_k: jax.Array     # [B, K, X, H] the 16-bit rows at kappa (device)
  fetched_v: jax.Array     # [B, K, X, H]
  miss: jax.Array          # [B] bool: every speculative guess of this step's real token was wrong
  spec_q: jax.Array        # [B, K, C·G, H] float32 the queries that chose κ, candidate-major (drift,
                           # track_hits; else [B, K, C·G, 0])
  anchor: jax.Array        # [B, W] int32 where the next input's rows copy from (lookup_rows; else [B, 0]):
                           # column 0 for the real row's own κ choice, 1.. for the candidates' κ_{t+1}


def init(method: SpeCacheConfig, model_cfg, batch, max_len, dtype) -> State:
  method.validate(model_cfg, max_len)
  s, k, h, x = method.slots(max_len), model_cfg.n_kv_heads, model_cfg.head_dim, method.topk
  host = (batch, k, 0 if method.offload else s, h)
  st = State(
      low=lowbit.init(batch, k, s, h, method.bits, method.group_size, method.residual, dtype),
      k16=jnp.zeros(host, dtype), v16=jnp.zeros(host, dtype),
      kappa=jnp.zeros((batch, k, x), jnp.int32),
      fetched_k=jnp.zeros((batch, k, x, h), dtype), fetched_v=jnp.zeros((batch, k, x, h), dtype),
      miss=jnp.zeros((batch,), bool),
      spec_q=jnp.zeros((batch, k, method.candidates * (model_cfg.n_heads // k),
                        h if _keeps_spec_query(method) else 0), jnp.float32),
      anchor=jnp.full((batch, method.decode_width if method.lookup_rows else 0), history.NONE, jnp.int32))
  return stack_layers(model_cfg.n_layers, st)


def _keeps_spec_query(method: SpeCacheConfig) -> bool:
  """drift needs the query that chose κ; track_hits (simulated) reports its drift."""
  return bool(method.drift) or (method.track_hits and not method.offload and method.speculative)


def prefill(method: SpeCacheConfig, st: State, k, v, lengths, colsum=None) -> State:
  del colsum
  k_BKTH, v_BKTH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  st = st.replace(low=lowbit.prefill(st.low, k_BKTH, v_BKTH, lengths, **method.qargs))
  if not method.offload:
    zero = jnp.zeros_like(lengths)
    st = st.replace(k16=A.write_rows(st.k16, k_BKTH, zero), v16=A.write_rows(st.v16, v_BKTH, zero))
  return st


def with_fetched(st: State, kappa_BKX, k_rows_BKXH, v_rows_BKXH) -> State:
  """The one writer of κ and its fetched 16-bit rows (the simulated gather and the host store both end here)."""
  return st.replace(kappa=kappa_BKX, fetched_k=k_rows_BKXH.astype(st.fetched_k.dtype),
                    fetched_v=v_rows_BKXH.astype(st.fetched_v.dtype))


def fetch_simulated(st: State, kappa_BKX) -> State:
  """The simulated transfer: the only read of the 16-bit cache, a gather at κ."""
  return with_fetched(st, kappa_BKX, A.gather_rows(st.k16, kappa_BKX), A.gather_rows(st.v16, kappa_BKX))


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
  """Whether a step may choose (and so fetch) its own κ_t before attention: the non-speculative ablation
  always; exact_on_miss for the rows whose speculative token was wrong; drift for the heads that drifted."""
  return (not method.speculative) or method.exact_on_miss or method.drift > 0


def corrected_heads(method: SpeCacheConfig, st: State, q):
  """[B, K] bool: the KV heads whose κ_t is chosen now from the real row (non-speculative: all; exact_on_miss:
  every head of a row whose speculative token missed; drift: the heads whose query drifted past it)."""
  b, n_kv = st.kappa.shape[:2]
  if not method.speculative:
    return jnp.ones((b, n_kv), bool)
  use = jnp.zeros((b, n_kv), bool)
  if method.exact_on_miss:
    use = use | st.miss[:, None]
  if method.drift:
    use = use | (query_drift(st, q) > method.drift)
  return use


def kappa_for_step(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """κ_t for this step's attention, chosen now from the real row (step 1 of a SpeCache step): the real row's own
  low-bit top-k for the `corrected_heads`, the prefetched κ_t for the others. Only called when
  `fetches_on_critical_path(method)`."""
  real = choose_nonspeculative(method, st, q[:, :1], k_new[:, :1], v_new[:, :1], lengths)
  return jnp.where(corrected_heads(method, st, q)[..., None], real, st.kappa)


def _fetched_for_step(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths) -> State:
  """Simulated: κ_t chosen now (`kappa_for_step`) and gathered, only where some head of the batch is corrected
  (a lax.cond; else the prefetched rows stand, which the choice would keep: exact_on_miss and drift skip the
  real row's scoring pass on a step whose guesses all hit). Only the small κ arrays pass through the cond."""
  def now():
    got = fetch_simulated(st, kappa_for_step(method, st, q, k_new, v_new, lengths))
    return got.kappa, got.fetched_k, got.fetched_v

  if not method.speculative:                         # every head, every step
    kappa, fetched_k, fetched_v = now()
  else:
    kappa, fetched_k, fetched_v = jax.lax.cond(jnp.any(corrected_heads(method, st, q)), now,
                                               lambda: (st.kappa, st.fetched_k, st.fetched_v))
  return st.replace(kappa=kappa, fetched_k=fetched_k, fetched_v=fetched_v)


def _probability_rows(method: SpeCacheConfig) -> tuple[int, ...]:
  """The decoding rows whose probabilities κ_{t+1} is chosen from: the real row's first when hedging, then the
  speculative candidates' (a single candidate as row -1: the form the fused kernels return)."""
  spec = (-1,) if method.candidates == 1 else tuple(range(1, 1 + method.candidates))
  return ((0,) if method.hedge else ()) + spec


def merge_candidates(method: SpeCacheConfig, probs_BKCS):
  """The speculative candidates' probabilities [B, K, C, S] -> one score per position [B, K, S]
  (`candidate_merge`: the largest, or the mean)."""
  return (jnp.max if method.candidate_merge == "max" else jnp.mean)(probs_BKCS, axis=2)


def _anchored(method: SpeCacheConfig, st: State, probs: selection.Scores, real: bool, n_B) -> selection.Scores:
  """With lookup_rows: the scores with the anchor windows of the real row (its own κ choice) or of the
  speculative candidates (κ_{t+1}) raised above every probability (`selection.anchored`), for an attend after
  n_B stored tokens (below its ring)."""
  if not method.lookup_rows:
    return probs
  low_below = lowbit.sixteen_bit_from(n_B, method.residual, method.exact_ring)
  return selection.anchored(probs, st.anchor[:, :1] if real else st.anchor[:, 1:], method.lookup_rows, low_below)


def _next_kappa(method: SpeCacheConfig, st: State, probs_BKRS: selection.Scores, lengths):
  """κ_{t+1} from this step's probabilities (rows: `_probability_rows`; with lookup_rows, the candidates'
  anchors first); candidates: `selection.candidates(method, n + 1)` (0..n, T_t included; with skip_ring only
  those below the ring)."""
  probs_BKRS = _anchored(method, st, probs_BKRS, real=False, n_B=lengths + 1)
  if method.candidates == 1 and not method.hedge:
    return selection.select_row(method, probs_BKRS, -1, lengths + 1)
  probs_BKRS = probs_BKRS.dense()
  spec = merge_candidates(method, probs_BKRS[:, :, -method.candidates:])
  if method.hedge:
    return selection.select_hedged(method, probs_BKRS[:, :, 0], spec, lengths + 1)
  return selection.select(method, spec, lengths + 1)


def attend_fetched(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """Steps 2-3 of a SpeCache step, given the fetched rows of κ_t in the state and the real row's codes already
  stored (the ring still without it): attend (16-bit at κ_t and the ring, low-bit elsewhere) and select
  κ_{t+1} (`_next_kappa`: the speculative row's top-k, part of it the real row's with hedge; recorded in
  `st.kappa`, fetched by the caller). -> (out [B,T,N,H], st, aux)

  aux: sync_fetch_heads [B], the fraction of KV heads whose κ_t was fetched on the critical path, with its
  counter sync_fetch_count (methods that may fetch so), and the top-k hit counters with track_hits."""
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)            # [B, K, T, H]
  aux = {}
  if fetches_on_critical_path(method):
    aux["sync_fetch_heads"] = jnp.mean(corrected_heads(method, st, q).astype(jnp.float32), axis=1)
    aux["sync_fetch_count"] = jnp.ones(lengths.shape, jnp.float32)
  aux.update(hit_stats(method, st, q, lengths, st.kappa))
  out, probs = mixed_attention(method, st, q, kn, vn, lengths, use_kappa=True,
                               rows=_probability_rows(method))
  if method.speculative:
    st = _with_spec_query(method, st.replace(kappa=_next_kappa(method, st, probs, lengths)), q)
  return out, st, aux


def _with_spec_query(method: SpeCacheConfig, st: State, q):
  """Record the queries that chose κ (the speculative candidates' rows 1.., or T1 in pre-decoding, standing for
  every candidate) for drift. -> spec_q [B, K, C·G, H]."""
  if not _keeps_spec_query(method):
    return st
  rows = q[:, 1:] if q.shape[1] > 1 else jnp.repeat(q, method.candidates, axis=1)     # [B, C, N, H]
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
  if method.speculative:
    st = _fetch(method, st, st.kappa)
  return out, st, aux


def observe_speculation(method: SpeCacheConfig, st: State, miss_B, anchors_BW=None) -> State:
  """Decode-loop hook: record, before the next step, which rows' speculative token was wrong (exact_on_miss
  acts on it; track_hits splits its statistics by it) and, with lookup_rows, the next input's anchors (either
  None: unchanged)."""
  if miss_B is not None and (method.exact_on_miss or method.track_hits):
    st = st.replace(miss=jnp.broadcast_to(miss_B, st.miss.shape))
  if method.lookup_rows and anchors_BW is not None:
    st = st.replace(anchor=jnp.broadcast_to(anchors_BW, st.anchor.shape).astype(jnp.int32))
  return st


def choose_nonspeculative(method: SpeCacheConfig, st: State, q, k_new, v_new, lengths):
  """κ_t of the non-speculative ablation: top-k of the real row's low-bit attention over stored positions (with
  correct_with_fetched, the rows of st.kappa scored from their fetched 16-bit keys)."""
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)
  _, probs = mixed_attention(method, st, q, kn, vn, lengths, use_kappa=method.correct_with_fetched,
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
