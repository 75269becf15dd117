"""Quest (query-aware sparsity, Tang et al. 2024): pages of the 16-bit cache picked by each step's query from
per-page key bounds.

The cache is cut into pages of `page_size` consecutive positions. The device keeps, per page, KV head and
channel, the smallest and largest key (`kmin`, `kmax`). A decoding step scores every stored page by the upper
bound of q·k over the page,

  bound(page) = Σ_c max(q_c · kmin_c, q_c · kmax_c),

and attends, in 16-bit, the rows of the `budget // page_size` best pages (the page holding the new token's
position, the current one, is always among them) plus the new rows; everything else is skipped. When those
pages cover every stored position, the step is the full cache's attention.

GQA (project choice; the paper's models are multi-head): a KV head's page score is the LARGEST bound over its G
query heads (and over the step's rows): a page one head of the group needs is kept, not averaged away by the
heads that ignore it. Quest keeps its first two layers dense; here every layer selects (a layer does not know its
index in the decoder's per-layer loop).

Simulated mode (`offload=False`): `k16/v16` are device arrays read only through the gather of the chosen pages'
rows (`fetch_simulated`), as SpeCache's simulated host cache is; they count as host bytes. Offloaded mode
(`offload=True`, runtime.py): `k16/v16` are absent ([B,K,0,H]); the 16-bit cache is in the host store, the
current page's rows stay on the device (`ring_k/ring_v`, written to the host when the page fills), and the other
X - 1 pages' rows are fetched from the host. Quest has no speculative token: a step's pages are chosen from its
own query (`kappa_for_step`), so every fetch is on the critical path — each layer waits for its rows before it
attends (SpeCache prefetches κ_{t+1} during the rest of step t). Device bytes, either mode: the page bounds, the
chosen pages and their rows (`budget` rows per KV head: the fetched ones and, offloaded, the current page's).
Axis letters as in caches/attention.py; P = pages, X = pages chosen per step, Y = X·page_size fetched rows
(offloaded: (X - 1)·page_size, and the current page's page_size rows in the ring).
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches.base import CacheConfig, check_int, check_offload, stack_layers
from specache_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class QuestConfig(CacheConfig):
  name = "quest"
  budget: int = 1024            # tokens attended per step, the new row's included (it lies in the current page):
                                # whole pages, a multiple of page_size (the paper's budgets: 256 to 4096)
  page_size: int = 16           # positions per page (the paper's 16)
  offload: bool = False         # True: the 16-bit cache lives in the host store (runtime.py)
  host_store: str = "auto"      # offloaded store: auto | pinned_host | numpy (offload.py)

  def __post_init__(self):
    check_int("page_size", self.page_size, 1)
    check_offload(self.offload, self.host_store)
    check_int("budget", self.budget, self.page_size)
    if self.budget % self.page_size:
      raise ConfigError(f"budget={self.budget} must be a multiple of page_size={self.page_size} "
                        "(whole pages are attended)")

  @property
  def impl(self):
    return sys.modules[__name__]

  def slots(self, max_len: int) -> int:
    return -(-max_len // self.page_size) * self.page_size

  def pages_chosen(self, max_len: int) -> int:
    """X: the pages attended per step, budget // page_size, at most the cache's pages (a budget over the cache
    attends all of it)."""
    return min(self.budget // self.page_size, self.slots(max_len) // self.page_size)


@struct.dataclass
class State:
  k16: jax.Array         # [B, K, S, H] the complete 16-bit keys (simulated host memory; [B, K, 0, H] offloaded)
  v16: jax.Array         # [B, K, S, H]
  kmin: jax.Array        # [B, K, P, H] per-page per-channel smallest key (device)
  kmax: jax.Array        # [B, K, P, H] largest key
  pages: jax.Array       # [B, K, X] int32 the pages the last step attended (the current one first)
  fetched_k: jax.Array   # [B, K, Y, H] their 16-bit rows (device), Y = X * page_size (offloaded: all but the
  fetched_v: jax.Array   # [B, K, Y, H]  current page's, (X - 1) * page_size)
  ring_k: jax.Array      # [B, K, page_size, H] offloaded: the current page's rows, position p at slot
  ring_v: jax.Array      # [B, K, page_size, H]  p % page_size (simulated: [B, K, 0, H])


def init(method: QuestConfig, model_cfg, batch: int, max_len: int, dtype) -> State:
  s, k, h = method.slots(max_len), model_cfg.n_kv_heads, model_cfg.head_dim
  x = method.pages_chosen(max_len)
  y = (x - method.offload) * method.page_size
  host, ring = (0, method.page_size) if method.offload else (s, 0)
  return stack_layers(model_cfg.n_layers, State(
      k16=jnp.zeros((batch, k, host, h), dtype), v16=jnp.zeros((batch, k, host, h), dtype),
      kmin=jnp.zeros((batch, k, s // method.page_size, h), dtype),
      kmax=jnp.zeros((batch, k, s // method.page_size, h), dtype),
      pages=jnp.zeros((batch, k, x), jnp.int32),
      fetched_k=jnp.zeros((batch, k, y, h), dtype), fetched_v=jnp.zeros((batch, k, y, h), dtype),
      ring_k=jnp.zeros((batch, k, ring, h), dtype), ring_v=jnp.zeros((batch, k, ring, h), dtype)))


def page_bounds(k_BKTH, lengths_B, page_size: int):
  """Per-page per-channel (min, max) of the keys at positions < lengths: [B, K, ceil(T / page_size), H] each
  (float32; 0 on a page with no stored position)."""
  b, n_kv, t, h = k_BKTH.shape
  pages = -(-t // page_size)
  k = jnp.pad(k_BKTH.astype(jnp.float32), ((0, 0), (0, 0), (0, pages * page_size - t), (0, 0)))
  k = k.reshape(b, n_kv, pages, page_size, h)
  held = (jnp.arange(pages * page_size)[None, :] < lengths_B[:, None]).reshape(b, 1, pages, page_size, 1)
  lo = jnp.min(jnp.where(held, k, jnp.inf), axis=3)
  hi = jnp.max(jnp.where(held, k, -jnp.inf), axis=3)
  some = jnp.any(held, axis=3)
  return jnp.where(some, lo, 0.0), jnp.where(some, hi, 0.0)


def prefill(method: QuestConfig, st: State, k, v, lengths, colsum=None) -> State:
  """Store a right-padded prompt (k, v [B, T, K, H], lengths [B]) in the 16-bit cache and its pages' bounds;
  offloaded, the runtime writes the prompt to the host store and the device keeps the rows of the page holding
  position `lengths` (the current page; positions past the prompt are filled as decoding reaches them)."""
  del colsum
  k_BKTH, v_BKTH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  lo, hi = page_bounds(k_BKTH, lengths, method.page_size)
  zero = jnp.zeros_like(lengths)
  if method.offload:
    kmin, kmax = A.write_many([(st.kmin, lo, zero), (st.kmax, hi, zero)])
    b, n_kv = k_BKTH.shape[:2]
    current = A.block_rows(jnp.broadcast_to((lengths.astype(jnp.int32) // method.page_size)[:, None, None],
                                            (b, n_kv, 1)), method.page_size)                 # [B, K, page_size]
    ring_k, ring_v = A.gather_rows(k_BKTH, current), A.gather_rows(v_BKTH, current)
    return st.replace(kmin=kmin, kmax=kmax, ring_k=ring_k.astype(st.ring_k.dtype),
                      ring_v=ring_v.astype(st.ring_v.dtype))
  k16, v16, kmin, kmax = A.write_many([(st.k16, k_BKTH, zero), (st.v16, v_BKTH, zero), (st.kmin, lo, zero),
                                       (st.kmax, hi, zero)])
  return st.replace(k16=k16, v16=v16, kmin=kmin, kmax=kmax)


def store(method: QuestConfig, st: State, kn_BKTH, vn_BKTH, lengths) -> State:
  """Write the T new rows at positions lengths .. lengths + T - 1 (offloaded: into the current page's ring) and
  fold each key into its page's bounds (a row that starts a page replaces the bounds)."""
  t = kn_BKTH.shape[2]
  if method.offload:
    k16, v16 = st.k16, st.v16
    ring_k, ring_v = st.ring_k, st.ring_v
    for i in range(t):
      slot = (lengths.astype(jnp.int32) + i) % method.page_size
      ring_k, ring_v = A.write_many([(ring_k, kn_BKTH[:, :, i:i + 1], slot), (ring_v, vn_BKTH[:, :, i:i + 1], slot)])
    st = st.replace(ring_k=ring_k, ring_v=ring_v)
  else:
    k16, v16 = A.write_many([(st.k16, kn_BKTH, lengths), (st.v16, vn_BKTH, lengths)])
  kmin, kmax = st.kmin, st.kmax
  for i in range(t):
    p = lengths.astype(jnp.int32) + i                                     # [B]
    page = jnp.broadcast_to((p // method.page_size)[:, None, None], kmin.shape[:2] + (1,))   # [B, K, 1]
    row = kn_BKTH[:, :, i:i + 1]                                          # [B, K, 1, H]
    starts = (p % method.page_size == 0)[:, None, None, None]
    lo = jnp.where(starts, row, jnp.minimum(A.gather_rows(kmin, page), row.astype(kmin.dtype)))
    hi = jnp.where(starts, row, jnp.maximum(A.gather_rows(kmax, page), row.astype(kmax.dtype)))
    kmin, kmax = A.write_many([(kmin, lo, page[:, 0, 0]), (kmax, hi, page[:, 0, 0])])
  return st.replace(k16=k16, v16=v16, kmin=kmin, kmax=kmax)


def page_scores(q_BTNH, kmin_BKPH, kmax_BKPH):
  """float32 [B, K, P]: each page's upper bound of q·k, Σ_c max(q_c·kmin_c, q_c·kmax_c) (= q⁺·kmax + q⁻·kmin),
  the largest over the G query heads of the KV head and the T rows."""
  rows = A.query_rows(A.split_heads(q_BTNH, kmin_BKPH.shape[1]))        # [B, K, G·T, H] float32
  pos = jnp.maximum(rows, 0.0)
  bound = A.bk_dot(pos, kmax_BKPH.astype(jnp.float32), 3) + A.bk_dot(rows - pos, kmin_BKPH.astype(jnp.float32), 3)
  return jnp.max(bound, axis=2)


def choose_pages(method: QuestConfig, st: State, q, lengths):
  """[B, K, X] int32: the current page (the one holding position `lengths`) and the X - 1 best-scored pages
  before it; where fewer pages are stored, the rest are later (empty) pages, which attention masks."""
  x = st.pages.shape[-1]
  current = (lengths.astype(jnp.int32) // method.page_size)[:, None, None]           # [B, 1, 1]
  page = jnp.arange(st.kmin.shape[2], dtype=jnp.int32)[None, None, :]
  score = page_scores(q, st.kmin, st.kmax)
  priority = jnp.where(page == current, jnp.inf, jnp.where(page < current, score, -jnp.inf))
  return jax.lax.top_k(priority, x)[1].astype(jnp.int32)


def fetch_simulated(method: QuestConfig, st: State, pages_BKX) -> State:
  """The simulated transfer: the only read of the 16-bit cache, a gather of the chosen pages' rows."""
  rows = A.block_rows(pages_BKX, method.page_size)
  return st.replace(pages=pages_BKX, fetched_k=A.gather_rows(st.k16, rows), fetched_v=A.gather_rows(st.v16, rows))


def attend(method: QuestConfig, st: State, q, k_new, v_new, lengths):
  """q [B,T,N,H], k/v_new [B,T,K,H] after `lengths` stored tokens: store the new rows, choose the pages from
  this step's queries, gather their 16-bit rows and attend them (positions < lengths) and the new rows
  (causal). Offloaded, the runtime has chosen the pages (`kappa_for_step`) and installed the host's rows
  (`with_fetched`); the current page's come from the ring. -> (out [B,T,N,H], st, {})."""
  b, t, _, h = q.shape
  n_kv = k_new.shape[2]
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)          # [B, K, T, H]
  st = store(method, st, kn, vn, lengths)
  if method.offload:
    current = jnp.broadcast_to((lengths.astype(jnp.int32) // method.page_size)[:, None, None], (b, n_kv, 1))
    st = st.replace(pages=st.pages.at[..., :1].set(current))
    keys, values = (jnp.concatenate([st.ring_k, st.fetched_k], axis=2),
                    jnp.concatenate([st.ring_v, st.fetched_v], axis=2))   # [B, K, X·page_size, H]
  else:
    st = fetch_simulated(method, st, choose_pages(method, st, q, lengths))
    keys, values = st.fetched_k, st.fetched_v
  stored = A.block_rows(st.pages, method.page_size) < lengths[:, None, None]  # [B, K, Y]
  mask = jnp.broadcast_to(stored[:, :, None, :], (b, n_kv, t, stored.shape[-1]))
  out, _ = A.segmented_attention(q, [(keys, values, mask), (kn, vn, A.causal_new_mask(b, t))], h ** -0.5, n_kv)
  return out, st, {}


# ----- the offloaded runtime's hooks (`base.OffloadModule`) -----

def prefetches(method: QuestConfig) -> bool:
  """No speculative token: the pages are known only from the step's own query (so no `next_index`)."""
  return False


def fetches_on_critical_path(method: QuestConfig) -> bool:
  return True


def kappa_for_step(method: QuestConfig, st: State, q, k_new, v_new, lengths):
  """[B, K, (X - 1)·page_size] int32: the rows of the pages the step attends but the current one (which the
  device holds), chosen as `attend` chooses them, after the new rows' keys are in the bounds."""
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)
  pages = choose_pages(method, store(method, st, kn, vn, lengths), q, lengths)
  return A.block_rows(pages[..., 1:], method.page_size)


def with_fetched(method: QuestConfig, st: State, rows_BKY, k_rows_BKYH, v_rows_BKYH) -> State:
  """The host's rows of the chosen pages (`kappa_for_step`'s rows), for the next attend."""
  return st.replace(pages=st.pages.at[..., 1:].set(rows_BKY[..., ::method.page_size] // method.page_size),
                    fetched_k=k_rows_BKYH.astype(st.fetched_k.dtype),
                    fetched_v=v_rows_BKYH.astype(st.fetched_v.dtype))


def flushes(method: QuestConfig, stored_B: np.ndarray):
  """The rows whose current page has just filled: its page_size rows, from stored - page_size."""
  return np.flatnonzero(stored_B % method.page_size == 0), stored_B - method.page_size


def flushed_rows(method: QuestConfig, st: State, start_B):
  del method, start_B
  return st.ring_k, st.ring_v


def device_bytes(method, st: State) -> int:
  """The page bounds, the chosen pages and their rows (offloaded: with the current page's ring); not the 16-bit
  cache (host memory)."""
  return tree_nbytes(st) - tree_nbytes((st.k16, st.v16))


def host_bytes(method, st: State) -> int:
  return tree_nbytes((st.k16, st.v16))
