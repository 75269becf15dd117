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

Simulated mode (the only one so far): `k16/v16` are device arrays read only through the gather of the chosen
pages' rows (`fetch_simulated`), as SpeCache's simulated host cache is; they count as host bytes. Device bytes:
the page bounds, the chosen pages and their fetched rows (`budget` rows per KV head).
Axis letters as in caches/attention.py; P = pages, X = pages chosen per step, Y = X·page_size fetched rows.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches.base import CacheConfig, check_int, stack_layers
from specache_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class QuestConfig(CacheConfig):
  name = "quest"
  budget: int = 1024            # tokens attended per step, the new row's included (it lies in the current page):
                                # whole pages, a multiple of page_size (the paper's budgets: 256 to 4096)
  page_size: int = 16           # positions per page (the paper's 16)

  def __post_init__(self):
    check_int("page_size", self.page_size, 1)
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
  k16: jax.Array         # [B, K, S, H] the complete 16-bit keys (simulated host memory)
  v16: jax.Array         # [B, K, S, H]
  kmin: jax.Array        # [B, K, P, H] per-page per-channel smallest key (device)
  kmax: jax.Array        # [B, K, P, H] largest key
  pages: jax.Array       # [B, K, X] int32 the pages the last step attended
  fetched_k: jax.Array   # [B, K, Y, H] their 16-bit rows (device), Y = X * page_size
  fetched_v: jax.Array   # [B, K, Y, H]


def init(method: QuestConfig, model_cfg, batch: int, max_len: int, dtype) -> State:
  s, k, h = method.slots(max_len), model_cfg.n_kv_heads, model_cfg.head_dim
  x = method.pages_chosen(max_len)
  y = x * method.page_size
  return stack_layers(model_cfg.n_layers, State(
      k16=jnp.zeros((batch, k, s, h), dtype), v16=jnp.zeros((batch, k, s, h), dtype),
      kmin=jnp.zeros((batch, k, s // method.page_size, h), dtype),
      kmax=jnp.zeros((batch, k, s // method.page_size, h), dtype),
      pages=jnp.zeros((batch, k, x), jnp.int32),
      fetched_k=jnp.zeros((batch, k, y, h), dtype), fetched_v=jnp.zeros((batch, k, y, h), dtype)))


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
  """Store a right-padded prompt (k, v [B, T, K, H], lengths [B]) in the 16-bit cache and its pages' bounds."""
  del colsum
  k_BKTH, v_BKTH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  lo, hi = page_bounds(k_BKTH, lengths, method.page_size)
  zero = jnp.zeros_like(lengths)
  k16, v16, kmin, kmax = A.write_many([(st.k16, k_BKTH, zero), (st.v16, v_BKTH, zero), (st.kmin, lo, zero),
                                       (st.kmax, hi, zero)])
  return st.replace(k16=k16, v16=v16, kmin=kmin, kmax=kmax)


def store(method: QuestConfig, st: State, kn_BKTH, vn_BKTH, lengths) -> State:
  """Write the T new rows at positions lengths .. lengths + T - 1 and fold each key into its page's bounds (a
  row that starts a page replaces the bounds)."""
  t = kn_BKTH.shape[2]
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


def page_rows(pages_BKX, page_size: int):
  """[B, K, X·page_size] int32: the positions of the pages' rows."""
  b, k, x = pages_BKX.shape
  rows = pages_BKX[..., None] * page_size + jnp.arange(page_size, dtype=jnp.int32)[None, None, None, :]
  return rows.reshape(b, k, x * page_size)


def fetch_simulated(method: QuestConfig, st: State, pages_BKX) -> State:
  """The simulated transfer: the only read of the 16-bit cache, a gather of the chosen pages' rows."""
  rows = page_rows(pages_BKX, method.page_size)
  return st.replace(pages=pages_BKX, fetched_k=A.gather_rows(st.k16, rows), fetched_v=A.gather_rows(st.v16, rows))


def attend(method: QuestConfig, st: State, q, k_new, v_new, lengths):
  """q [B,T,N,H], k/v_new [B,T,K,H] after `lengths` stored tokens: store the new rows, choose the pages from
  this step's queries, gather their 16-bit rows and attend them (positions < lengths) and the new rows
  (causal). -> (out [B,T,N,H], st, {})."""
  b, t, _, h = q.shape
  n_kv = k_new.shape[2]
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)          # [B, K, T, H]
  st = store(method, st, kn, vn, lengths)
  st = fetch_simulated(method, st, choose_pages(method, st, q, lengths))
  stored = page_rows(st.pages, method.page_size) < lengths[:, None, None]  # [B, K, Y]
  mask = jnp.broadcast_to(stored[:, :, None, :], (b, n_kv, t, stored.shape[-1]))
  out, _ = A.segmented_attention(q, [(st.fetched_k, st.fetched_v, mask), (kn, vn, A.causal_new_mask(b, t))],
                                 h ** -0.5, n_kv)
  return out, st, {}


def device_bytes(method, st: State) -> int:
  """The page bounds, the chosen pages and their rows; not the 16-bit cache (host memory)."""
  return tree_nbytes(st) - tree_nbytes((st.k16, st.v16))


def host_bytes(method, st: State) -> int:
  return tree_nbytes((st.k16, st.v16))
