"""InfLLM (Xiao et al. 2024): initial tokens, a local window, and memory blocks retrieved by their representative
tokens.

Positions are split, for a step after n stored tokens, into
  initial   [0, n_init)                           always attended;
  blocks    [n_init + j·block_size, +block_size)  for j < c(n), the blocks wholly out of the window;
  window    [n_init + c(n)·block_size, n)         the local window: between local - block_size and local - 1
                                                  stored tokens, plus the new row (so `local` with it);
with c(n) = max(0, (n - n_init - local + block_size) // block_size). A block leaves the window whole (InfLLM
forms a memory block once block_size tokens have left the window; here the window shrinks by a block at once, so
no token is ever between the two). Each block keeps one representative key on the device: the mean of its
`repr_topk` keys with the largest representative score, the attention the key received while in the window
(prefill: from every later prompt row, the decoder's column sums; decode: from each step's rows), fixed when the
block leaves the window. A step scores each block by q·representative (a mean, so the same order as the paper's
sum over the representatives) and attends, in 16-bit, the initial tokens, the `topk` best blocks, the window and
the new rows: `budget` = n_init + local + topk·block_size tokens. When every block fits, the step is the full
cache's attention.

Settings default to the paper's (Mistral / Llama-3 configs): 128 initial tokens, blocks of 128 with 4
representatives; the rest of the budget is split as the paper's 4096-token window and 16 blocks (2048 tokens)
are: a third (whole blocks) retrieved, the rest the window.
GQA (project choice, as Quest's): a KV head's block score is the largest over its G query heads and the rows.
The paper's GPU block cache (LRU over retrieved blocks) and its chunked prefill are not modelled: the prompt is
prefilled with full attention, as every method here.

Simulated mode (`offload=False`): `k16/v16` are device arrays read only through the gather of the attended rows
(`fetch_simulated`), counted as host bytes. Offloaded mode (`offload=True`, runtime.py), as the paper places the
cache: `k16/v16` are absent ([B,K,0,H]); the 16-bit cache is in the host store, the initial tokens and the local
window stay on the device (`init_k`, and `ring_k` holding position p at slot (p - n_init) % window), a block is
written to the host as it leaves the window, and the chosen blocks' rows are fetched from the host. InfLLM has no
speculative token: a step's blocks are chosen from its own query (`kappa_for_step`), so every fetch is on the
critical path — each layer waits for its blocks before it attends. Device bytes: the representatives, the chosen
blocks, the attended rows (simulated: fetched; offloaded: the initial tokens, the window's ring — one row more
than the simulated window — and the fetched blocks), and the window's representative scores (the state keeps a
score per position; only the window's are live, and only those count).
Axis letters as in caches/attention.py; J = blocks, X = blocks chosen, Y = n_init + local - 1 + X·block_size
fetched rows (offloaded: X·block_size).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches.base import CacheConfig, check_int, check_offload, stack_layers
from specache_jax.caches.quest import page_scores
from specache_jax.errors import ConfigError

PAPER_LOCAL, PAPER_RETRIEVED = 4096, 16 * 128     # the paper's window and retrieved tokens (their 2:1 split)


@dataclasses.dataclass(frozen=True)
class InfLLMConfig(CacheConfig):
  name = "infllm"
  needs_attention_colsum = True
  budget: int = 128 + PAPER_LOCAL + PAPER_RETRIEVED   # tokens attended per step: n_init + window + topk·block_size
  n_init: int = 128                 # initial tokens, always attended
  block_size: int = 128             # tokens per memory block
  repr_topk: int = 4                # representative tokens per block
  local: int | None = None          # the least window (incl. the new row): the blocks are the whole ones that
                                    # budget - n_init - local holds, the window the rest; None: the blocks are
                                    # the whole ones in a third of budget - n_init (the paper's split)
  offload: bool = False             # True: the 16-bit cache lives in the host store (runtime.py)
  host_store: str = "auto"          # offloaded store: auto | pinned_host | numpy (offload.py)

  def __post_init__(self):
    check_offload(self.offload, self.host_store)
    check_int("n_init", self.n_init, 0)
    check_int("block_size", self.block_size, 1)
    check_int("repr_topk", self.repr_topk, 1)
    check_int("budget", self.budget, self.n_init + self.block_size)
    if self.repr_topk > self.block_size:
      raise ConfigError(f"repr_topk={self.repr_topk} must be <= block_size={self.block_size}")
    if self.local is not None:
      check_int("local", self.local, self.block_size)
      if self.n_init + self.local > self.budget:
        raise ConfigError(f"n_init={self.n_init} + local={self.local} must be <= budget={self.budget}")

  @property
  def impl(self):
    return sys.modules[__name__]

  @property
  def topk(self) -> int:
    """Blocks retrieved per step."""
    if self.local is None:
      return (self.budget - self.n_init) * PAPER_RETRIEVED // (PAPER_LOCAL + PAPER_RETRIEVED) // self.block_size
    return (self.budget - self.n_init - self.local) // self.block_size

  @property
  def window(self) -> int:
    """The local window incl. the new row: what the budget leaves after the initial tokens and the blocks."""
    return self.budget - self.n_init - self.topk * self.block_size

  def blocks(self, max_len: int) -> int:
    """J: the memory blocks `max_len` slots hold (at least one, so shapes stay non-empty)."""
    return max(1, -(-(max_len - self.n_init) // self.block_size))


@struct.dataclass
class State:
  k16: jax.Array         # [B, K, S, H] the complete 16-bit keys (simulated host memory; [B, K, 0, H] offloaded)
  v16: jax.Array         # [B, K, S, H]
  score: jax.Array       # [B, K, S] float32 representative score (attention received while in the window)
  reps: jax.Array        # [B, K, J, H] each formed block's representative key (device)
  chosen: jax.Array      # [B, K, X] int32 the blocks the last step attended
  fetched_k: jax.Array   # [B, K, Y, H] the rows the last step attended (device; offloaded: the blocks')
  fetched_v: jax.Array   # [B, K, Y, H]
  init_k: jax.Array      # [B, K, n_init, H] offloaded: the initial tokens (device; simulated [B, K, 0, H])
  init_v: jax.Array      # [B, K, n_init, H]
  ring_k: jax.Array      # [B, K, window, H] offloaded: the window, position p at slot (p - n_init) % window
  ring_v: jax.Array      # [B, K, window, H]  (simulated [B, K, 0, H])


def _rows(method: InfLLMConfig, max_len: int) -> tuple[int, int]:
  x = min(method.topk, method.blocks(max_len))
  return x, method.n_init + method.window - 1 + x * method.block_size


def init(method: InfLLMConfig, model_cfg, batch: int, max_len: int, dtype) -> State:
  k, h = model_cfg.n_kv_heads, model_cfg.head_dim
  x, y = _rows(method, max_len)
  host, n0, ring = (0, method.n_init, method.window) if method.offload else (max_len, 0, 0)
  y = x * method.block_size if method.offload else y
  rows = lambda n: jnp.zeros((batch, k, n, h), dtype)                     # noqa: E731
  return stack_layers(model_cfg.n_layers, State(
      k16=rows(host), v16=rows(host), score=jnp.zeros((batch, k, max_len), jnp.float32),
      reps=jnp.zeros((batch, k, method.blocks(max_len), h), dtype), chosen=jnp.zeros((batch, k, x), jnp.int32),
      fetched_k=rows(y), fetched_v=rows(y), init_k=rows(n0), init_v=rows(n0), ring_k=rows(ring), ring_v=rows(ring)))


def ring_slot(method: InfLLMConfig, pos):
  """The ring slot of window position(s) pos (offloaded)."""
  return (pos - method.n_init) % method.window


def formed(method: InfLLMConfig, n_B):
  """[B] int32 c(n): the blocks wholly out of the window after n stored tokens (a numpy n_B, the runtime's
  host-side flush check, gives numpy)."""
  xp = np if isinstance(n_B, np.ndarray) else jnp
  return xp.maximum(0, (n_B.astype(xp.int32) - method.n_init - method.window + method.block_size)
                    // method.block_size)


def _block_reps(method: InfLLMConfig, keys_at, score_BKS, first_B, n_blocks: int):
  """Representatives [B, K, n_blocks, H] (float32) of blocks first .. first + n_blocks - 1 of each row
  (first_B [B] int32). keys_at: positions [B, K, P] -> their 16-bit keys [B, K, P, H] (a position with no
  stored key reads some other row: such a block is never a candidate)."""
  bs = method.block_size
  b, n_kv = score_BKS.shape[:2]
  pos_BP = method.n_init + first_B.astype(jnp.int32)[:, None] * bs + jnp.arange(n_blocks * bs, dtype=jnp.int32)[None]
  pos_BKP = jnp.broadcast_to(pos_BP[:, None, :], (b, n_kv, n_blocks * bs))
  keys = keys_at(pos_BKP).astype(jnp.float32).reshape(b, n_kv, n_blocks, bs, -1)
  s = jnp.take_along_axis(score_BKS, jnp.clip(pos_BKP, 0, score_BKS.shape[-1] - 1), axis=-1)
  _, top = jax.lax.top_k(s.reshape(b, n_kv, n_blocks, bs), method.repr_topk)        # [B, K, J, r]
  return jnp.mean(jnp.take_along_axis(keys, top[..., None], axis=3), axis=3)


def prefill(method: InfLLMConfig, st: State, k, v, lengths, colsum=None) -> State:
  """Store a right-padded prompt (k, v [B, T, K, H], lengths [B]), its representative scores (the column sums
  colsum [B, K, T]) and the representatives of every block it fills (those that leave the window later are
  formed again then). Offloaded, the runtime writes the prompt to the host store and the device keeps its
  initial tokens and its window (`_device_rows`)."""
  if colsum is None:
    raise ValueError("infllm.prefill needs the prompt's attention column sums (colsum [B, K, T])")
  t = k.shape[1]
  k_BKTH, v_BKTH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  zero = jnp.zeros_like(lengths)
  held = jnp.arange(t)[None, None, :] < lengths[:, None, None]
  score = st.score.at[:, :, :t].set(jnp.where(held, colsum.astype(jnp.float32), 0.0))
  if method.offload:
    k16, v16 = st.k16, st.v16
    st = _device_rows(method, st, k_BKTH, v_BKTH, lengths)
    keys = k_BKTH.astype(st.ring_k.dtype)                                 # the keys as the cache holds them
    keys_at = lambda pos: A.gather_rows(keys, pos)                        # noqa: E731
  else:
    k16, v16 = A.write_many([(st.k16, k_BKTH, zero), (st.v16, v_BKTH, zero)])
    keys_at = lambda pos: A.gather_rows(k16, pos)                         # noqa: E731
  n_blocks = max(0, min(st.reps.shape[2], (t - method.n_init) // method.block_size))
  if n_blocks:
    st = st.replace(reps=A.write_rows(st.reps, _block_reps(method, keys_at, score, zero, n_blocks), zero))
  return st.replace(k16=k16, v16=v16, score=score)


def _device_rows(method: InfLLMConfig, st: State, k_BKTH, v_BKTH, lengths) -> State:
  """Offloaded prefill: the prompt's initial tokens and, in the ring, the positions from the window's start on
  (those past the prompt are filled as decoding reaches them)."""
  b, n_kv, t, _ = k_BKTH.shape
  start = (method.n_init + formed(method, lengths) * method.block_size)[:, None]             # [B, 1]
  slot = jnp.arange(method.window, dtype=jnp.int32)[None, :]
  pos = start + (slot - ring_slot(method, start)) % method.window                            # [B, window]
  pos_BKW = jnp.broadcast_to(pos[:, None, :], (b, n_kv, method.window))
  init_BKI = jnp.broadcast_to(jnp.arange(method.n_init, dtype=jnp.int32)[None, None, :], (b, n_kv, method.n_init))
  rows = lambda x, at: A.gather_rows(x, at).astype(st.ring_k.dtype)      # noqa: E731
  return st.replace(init_k=rows(k_BKTH, init_BKI), init_v=rows(v_BKTH, init_BKI), ring_k=rows(k_BKTH, pos_BKW),
                    ring_v=rows(v_BKTH, pos_BKW))


def rows_of(method: InfLLMConfig, chosen_BKX, n_B):
  """([B, K, Y] int32 positions, [B, K, Y] bool attended): the initial tokens, the chosen blocks and the window
  for a step after n stored tokens (chosen blocks at or past c(n) are not attended)."""
  b, n_kv, x = chosen_BKX.shape
  n = n_B.astype(jnp.int32)[:, None, None]
  c = formed(method, n_B)[:, None, None]
  init = jnp.broadcast_to(jnp.arange(method.n_init, dtype=jnp.int32)[None, None, :], (b, n_kv, method.n_init))
  blocks = A.block_rows(chosen_BKX, method.block_size, method.n_init)
  block_ok = jnp.broadcast_to((chosen_BKX < c)[..., None], (b, n_kv, x, method.block_size)).reshape(b, n_kv, -1)
  start = method.n_init + c * method.block_size
  window = start + jnp.arange(method.window - 1, dtype=jnp.int32)[None, None, :]
  pos = jnp.concatenate([init, blocks, jnp.broadcast_to(window, (b, n_kv, window.shape[-1]))], axis=-1)
  ok = jnp.concatenate([init < n, block_ok, jnp.broadcast_to(window < n, (b, n_kv, window.shape[-1]))], axis=-1)
  return pos, ok


def choose_blocks(method: InfLLMConfig, st: State, q, n_B):
  """[B, K, X] int32: the X formed blocks (j < c(n)) with the largest q·representative; where fewer are formed,
  later (unformed) blocks fill the rest and are not attended."""
  j = jnp.arange(st.reps.shape[2], dtype=jnp.int32)[None, None, :]
  score = page_scores(q, st.reps, st.reps)                # q·rep: the bound with min = max = the representative
  priority = jnp.where(j < formed(method, n_B)[:, None, None], score, -jnp.inf)
  return jax.lax.top_k(priority, st.chosen.shape[-1])[1].astype(jnp.int32)


def fetch_simulated(st: State, chosen_BKX, pos_BKY) -> State:
  """The simulated transfer: the only read of the 16-bit cache, a gather of the attended rows."""
  return st.replace(chosen=chosen_BKX, fetched_k=A.gather_rows(st.k16, pos_BKY),
                    fetched_v=A.gather_rows(st.v16, pos_BKY))


def attend(method: InfLLMConfig, st: State, q, k_new, v_new, lengths):
  """q [B,T,N,H], k/v_new [B,T,K,H] after `lengths` stored tokens: choose the blocks, gather and attend the
  initial tokens, the blocks and the window (positions < lengths) and the new rows (causal); the attention the
  window and the new rows receive is added to their representative scores; then the new rows are stored, and
  each block that leaves the window gets its representative. -> (out [B,T,N,H], st, {})."""
  b, t, n, h = q.shape
  n_kv = k_new.shape[2]
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)          # [B, K, T, H]
  if method.offload:                          # the runtime chose the blocks and installed their rows
    pos, ok = rows_of(method, st.chosen, lengths)
    keys, values = _attended_rows(method, st, pos)
  else:
    chosen = choose_blocks(method, st, q, lengths)
    pos, ok = rows_of(method, chosen, lengths)
    st = fetch_simulated(st, chosen, pos)
    keys, values = st.fetched_k, st.fetched_v
  mask = jnp.broadcast_to(ok[:, :, None, :], (b, n_kv, t, pos.shape[-1]))
  out, (p_old, p_new) = A.segmented_attention(
      q, [(keys, values, mask), (kn, vn, A.causal_new_mask(b, t))], h ** -0.5, n_kv)
  g = n // n_kv
  s_len = st.score.shape[-1]
  bi, ki = jnp.arange(b)[:, None, None], jnp.arange(n_kv)[None, :, None]
  w = method.window - 1                                                   # the window's columns come last
  score = st.score
  if w:
    got_w = jnp.einsum("bkgts->bks", p_old[..., -w:]) / g                 # [B, K, w]
    idx = jnp.where(ok[..., -w:], pos[..., -w:], s_len)                   # out of range: dropped
    score = score.at[bi, ki, idx].add(got_w, mode="drop")
  got_new = jnp.einsum("bkgts->bks", p_new) / g                           # [B, K, T]
  new_pos = jnp.broadcast_to(lengths.astype(jnp.int32)[:, None, None] + jnp.arange(t)[None, None, :], got_new.shape)
  score = score.at[bi, ki, new_pos].set(got_new, mode="drop")
  if method.offload:
    st = _store_on_device(method, st.replace(score=score), kn, vn, lengths)
    keys_at = lambda pos: A.gather_rows(st.ring_k, ring_slot(method, pos))   # noqa: E731 (the block is in it)
  else:
    k16, v16 = A.write_many([(st.k16, kn, lengths), (st.v16, vn, lengths)])
    st = st.replace(k16=k16, v16=v16, score=score)
    keys_at = lambda pos: A.gather_rows(st.k16, pos)                      # noqa: E731
  for i in range(t):                         # a row may push the window's oldest block out: its representative
    n1 = lengths + i + 1
    j = jnp.maximum(formed(method, n1) - 1, 0)                            # [B]
    now = (formed(method, n1) > formed(method, n1 - 1))[:, None, None, None]
    held = A.gather_rows(st.reps, jnp.broadcast_to(j[:, None, None], st.chosen.shape[:2] + (1,)))
    rep = jnp.where(now, _block_reps(method, keys_at, st.score, j, 1).astype(held.dtype), held)
    st = st.replace(reps=A.write_rows(st.reps, rep, j))
  return out, st, {}


def _attended_rows(method: InfLLMConfig, st: State, pos_BKY):
  """Offloaded: the attended rows in `rows_of`'s order — the initial tokens, the fetched blocks, the window
  (from the ring) -> (keys, values) [B, K, n_init + X·block_size + window - 1, H]."""
  win = ring_slot(method, pos_BKY[..., method.n_init + st.fetched_k.shape[2]:])
  return tuple(jnp.concatenate([first, fetched, A.gather_rows(ring, win)], axis=2)
               for first, fetched, ring in ((st.init_k, st.fetched_k, st.ring_k), (st.init_v, st.fetched_v, st.ring_v)))


def _store_on_device(method: InfLLMConfig, st: State, kn_BKTH, vn_BKTH, lengths) -> State:
  """Offloaded: the T new rows into the ring (a position below n_init also into the initial tokens; its ring
  slot is one no stored position holds then)."""
  b, n_kv = kn_BKTH.shape[:2]
  for i in range(kn_BKTH.shape[2]):
    p = lengths.astype(jnp.int32) + i                                     # [B]
    k, v = kn_BKTH[:, :, i:i + 1], vn_BKTH[:, :, i:i + 1]
    writes = [(st.ring_k, k, ring_slot(method, p)), (st.ring_v, v, ring_slot(method, p))]
    if method.n_init:
      at = jnp.minimum(p, method.n_init - 1)
      first = (p < method.n_init)[:, None, None, None]
      at_BK1 = jnp.broadcast_to(at[:, None, None], (b, n_kv, 1))
      writes += [(st.init_k, jnp.where(first, k, A.gather_rows(st.init_k, at_BK1)), at),
                 (st.init_v, jnp.where(first, v, A.gather_rows(st.init_v, at_BK1)), at)]
    out = A.write_many(writes)
    st = st.replace(ring_k=out[0], ring_v=out[1], **(dict(init_k=out[2], init_v=out[3]) if method.n_init else {}))
  return st


# ----- the offloaded runtime's hooks (`base.OffloadModule`) -----

def prefetches(method: InfLLMConfig) -> bool:
  """No speculative token: the blocks are known only from the step's own query (so no `next_index`)."""
  return False


def fetches_on_critical_path(method: InfLLMConfig) -> bool:
  return True


def kappa_for_step(method: InfLLMConfig, st: State, q, k_new, v_new, lengths):
  """The rows of the blocks the step attends, chosen as `attend` chooses them (`choose_blocks`)."""
  return A.block_rows(choose_blocks(method, st, q, lengths), method.block_size, method.n_init)


def with_fetched(method: InfLLMConfig, st: State, rows_BKY, k_rows_BKYH, v_rows_BKYH) -> State:
  """The host's rows of the chosen blocks (`kappa_for_step`'s rows), for the next attend."""
  chosen = (rows_BKY[..., ::method.block_size] - method.n_init) // method.block_size
  return st.replace(chosen=chosen.astype(jnp.int32), fetched_k=k_rows_BKYH.astype(st.fetched_k.dtype),
                    fetched_v=v_rows_BKYH.astype(st.fetched_v.dtype))


def flushes(method: InfLLMConfig, stored_B: np.ndarray):
  """The rows where a block has just left the window (after stored_B tokens): it goes to the host whole."""
  stored_B = np.asarray(stored_B)
  now = formed(method, stored_B)
  return np.flatnonzero(now > formed(method, stored_B - 1)), method.n_init + np.maximum(now - 1, 0) * method.block_size


@functools.partial(jax.jit, static_argnums=0)
def _block_from_ring(method: InfLLMConfig, ring_k, ring_v, start_B):
  b, n_kv = ring_k.shape[:2]
  pos = start_B[:, None] + jnp.arange(method.block_size, dtype=jnp.int32)[None, :]
  slot = jnp.broadcast_to(ring_slot(method, pos)[:, None, :], (b, n_kv, method.block_size))
  return A.gather_rows(ring_k, slot), A.gather_rows(ring_v, slot)


def flushed_rows(method: InfLLMConfig, st: State, start_B):
  """The block `flushes` named, gathered from the ring into new arrays [B, K, block_size, H] (the ring itself is
  updated in place by the next steps)."""
  return _block_from_ring(method, st.ring_k, st.ring_v, jnp.asarray(start_B, jnp.int32))


def device_bytes(method, st: State) -> int:
  """The representatives, the chosen blocks, the fetched rows and the window's scores; not the 16-bit cache
  (host memory) nor the scores of positions out of the window (kept only because the simulation indexes by
  position)."""
  live = 4 * math.prod(st.score.shape[:-1]) * min(method.window, st.score.shape[-1])   # [..., B, K] heads
  return tree_nbytes(st) - tree_nbytes((st.k16, st.v16, st.score)) + live


def host_bytes(method, st: State) -> int:
  return tree_nbytes((st.k16, st.v16))
