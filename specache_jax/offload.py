"""The host-memory 16-bit KV store, its asynchronous top-k row fetch, and the memory plan (memory_plan.py).

Two stores behind one interface (`write_prompt`, `write_block`, `fetch` of a group of consecutive layers' κ
rows; the result's item i is layer i of the group's (k, v) rows, a pair or one [2, B, K, X, H] array):
  PinnedHostStore  per-layer K/V arrays with `memory_kind="pinned_host"` shardings. Writes and the κ gather run
                   as host computations (`compute_on("device_host")`) on those arrays, and only the gathered
                   block [B, K, X, H] moves to the device with `jax.device_put` — nothing on the device ever
                   indexes a host array. Every call is dispatched asynchronously: `fetch` returns before its data
                   is ready.
  NumpyHostStore   the default ("auto"): numpy arrays in host RAM; writes and gathers run in one background thread
                   (FIFO, so a written block is always visible to a later gather) and the block is
                   `jax.device_put` from it. Its `fetch` returns a `PendingFetch`: waiting on it raises
                   `HostStoreError` (naming the layer group, the worker's exception chained) when the gather, or
                   a write queued before it, failed, and `HostFetchTimeout` when the block is not ready within
                   `fetch_timeout_s` ($SPECACHE_JAX_FETCH_TIMEOUT_S, 60 s by default): a fault of the worker
                   stops the generation at the next wait, never hangs it or lets it read stale rows.
Decoded rows reach the host a ring flush at a time (`write_block`, called by the runtime when a row's
residual ring fills, every R steps: its R rows at once), not a row per step: an attend reads a κ row from the
host only below the ring's 16-bit keys (key_qlen), and those rows are exactly the flushed ones. A flush moves
the whole [B, K, R, H] ring of that layer (every batch row's, written only for the rows that filled): one row per
step and batch row on average when the rows' lengths agree mod R, up to B times that when they are ragged.
Axis letters as in caches/attention.py; X = k rows fetched per KV head.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding, PartitionSpec as P

from specache_jax import multiprocess, sharding
from specache_jax.arrays import Ready
from specache_jax.host_worker import (  # noqa: F401 (the errors and the setting, importable from here too)
    FETCH_TIMEOUT_ENV, HostFetchTimeout, HostStoreError, PendingFetch, Worker, resolve_fetch_timeout)
from specache_jax.memory_plan import (  # noqa: F401 (the runtime's plan, importable from here too)
    PINNED_LIMIT_DEFAULT_GIB, PINNED_LIMIT_ENV, MemoryPlan, MemoryPlanError, pinned_limit_bytes, plan_memory,
    prefill_activation_bytes, resolve_store_kind)


# ----- pinned_host store: host computations on host-memory arrays -----

_COMPUTE_ON_TAKES_SPACES = "out_memory_spaces" in inspect.signature(compute_on).parameters


def _on_host(fn, *args):
  """fn(*args) as a host computation ("device_host") whose outputs stay in host memory. jax 0.10 has
  `compute_on` as a context manager; 0.11 made it a function transform with keyword-only `compute_type` and
  `out_memory_spaces`: both are handled here, so the store runs on either."""
  if _COMPUTE_ON_TAKES_SPACES:
    return compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(fn)(*args)
  with compute_on("device_host"):
    return fn(*args)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("row0",))
def _host_write_at(buf_BKSH, rows_nKTH, *, row0):
  """Sequences row0.. of buf get rows_nKTH at positions 0.. (a prompt: one block, host computation)."""
  return _on_host(lambda b, r: jax.lax.dynamic_update_slice(b, r, (row0, 0, 0, 0)), buf_BKSH, rows_nKTH)


def _write_rows_where(buf_BKSH, rows_BKTH, start_B, write_B):
  """Rows of batch entries with write_B at start_B (the others rewrite what they hold: same shapes every call)."""
  for b in range(buf_BKSH.shape[0]):
    at = (b, 0, start_B[b], 0)
    held = jax.lax.dynamic_slice(buf_BKSH, at, (1,) + rows_BKTH.shape[1:])
    buf_BKSH = jax.lax.dynamic_update_slice(buf_BKSH, jnp.where(write_B[b], rows_BKTH[b:b + 1], held), at)
  return buf_BKSH


@functools.partial(jax.jit, donate_argnums=0)
def _host_write_where(buf_BKSH, rows_BKTH, start_B, write_B):
  return _on_host(_write_rows_where, buf_BKSH, rows_BKTH, start_B, write_B)


@jax.jit
def _host_gather(buf_BKSH, idx_BKX):
  return _on_host(jax.vmap(jax.vmap(lambda b, i: b[i])), buf_BKSH, idx_BKX)       # [B, K, X, H]


@jax.jit
def _to_BKTH(x_BTKH):
  return jnp.swapaxes(x_BTKH, 1, 2)


class PinnedHostStore:
  kind = "pinned_host"

  def __init__(self, n_layers, batch, n_kv, slots, head_dim, dtype, device=None):
    self.device = device or jax.devices()[0]
    self.host = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
    self.on_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
    shape = (batch, n_kv, slots, head_dim)
    self.k = [jax.device_put(np.zeros(shape, dtype), self.host) for _ in range(n_layers)]
    self.v = [jax.device_put(np.zeros(shape, dtype), self.host) for _ in range(n_layers)]

  def _put_host(self, x):
    return jax.device_put(x, self.host)

  def write_prompt(self, layer, k_BTKH, v_BTKH, row0: int = 0):
    """The prompt's k/v [n, T, K, H] of sequences row0..row0+n-1, at positions 0..T-1."""
    self.k[layer] = _host_write_at(self.k[layer], self._put_host(_to_BKTH(k_BTKH)), row0=row0)
    self.v[layer] = _host_write_at(self.v[layer], self._put_host(_to_BKTH(v_BTKH)), row0=row0)

  def write_block(self, layer, k_BKTH, v_BKTH, start_B, rows):
    """Batch rows `rows` (numpy ints) of k/v [B, K, T, H] at positions start_B[b] .. + T (numpy [B])."""
    write = np.zeros(len(start_B), bool)
    write[np.asarray(rows, int)] = True
    start = self._put_host(np.where(write, start_B, 0).astype(np.int32))
    write = self._put_host(write)
    self.k[layer] = _host_write_where(self.k[layer], self._put_host(k_BKTH), start, write)
    self.v[layer] = _host_write_where(self.v[layer], self._put_host(v_BKTH), start, write)

  def fetch(self, layers, kappas_BKX):
    """The rows at κ of each layer in `layers` -> Ready(((k_rows, v_rows) per layer)), each [B, K, X, H]."""
    out = []
    for layer, kappa_BKX in zip(layers, kappas_BKX, strict=True):
      idx = self._put_host(kappa_BKX)
      out.append((jax.device_put(_host_gather(self.k[layer], idx), self.on_device),
                  jax.device_put(_host_gather(self.v[layer], idx), self.on_device)))
    return Ready(tuple(out))

  def arrays(self):
    return self.k + self.v

  @property
  def nbytes(self) -> int:
    return int(sum(a.nbytes for a in self.arrays()))

  def close(self):
    pass


# ----- numpy fallback: a background thread gathers, device_put transfers -----

def take_rows(buf_LBKSH: np.ndarray, idx_BKX: np.ndarray) -> np.ndarray:
  """Rows of buf [..., B, K, S, H] (any leading axes, e.g. layers and K/V stacked) at slots idx [..., B, K, X]
  (broadcast against the leading axes, e.g. [G, 1, B, K, X] for the same κ for K and V; clipped into range, as
  `attention.gather_rows`) -> a new [..., B, K, X, H] array, 64-byte aligned (`aligned_empty`). One `np.take` of
  whole rows over the flattened [rows, H] view, straight into the new array (mode="clip": with the default
  mode numpy gathers into a temporary first): np.take_along_axis builds an index per element (~6x slower here,
  ~15 ms of a 2-core CPU per step at 30 layers, competing with the step's compute)."""
  *lead, s, h = buf_LBKSH.shape
  n = int(np.prod(lead))
  flat = np.arange(n, dtype=np.int64).reshape(tuple(lead) + (1,)) * s + np.clip(idx_BKX, 0, s - 1)
  out = aligned_empty(flat.shape + (h,), buf_LBKSH.dtype)
  np.take(buf_LBKSH.reshape(n * s, h), flat.reshape(-1), axis=0, out=out.reshape(-1, h), mode="clip")
  return out


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """np.empty whose data starts at a multiple of `align` bytes: XLA:CPU's `device_put(..., may_alias=True)` then
  uses the array's memory as the device buffer instead of copying it (it copies a less aligned array)."""
  dtype = np.dtype(dtype)
  size = int(np.prod(shape))
  raw = np.empty(size * dtype.itemsize + align, np.uint8)
  off = -raw.ctypes.data % align
  return raw[off:off + size * dtype.itemsize].view(dtype).reshape(shape)


def _start_copies(arrays) -> None:
  """Start each device array's copy to the host (`copy_to_host_async`) as its producer is dispatched: the
  worker's np.asarray then waits for the producer's compute and no transfer, and the dispatching thread, which
  only queues the job, never waits for either. Numpy arrays pass through."""
  for a in arrays:
    if isinstance(a, jax.Array):
      a.copy_to_host_async()


class NumpyHostStore:
  kind = "numpy"

  def __init__(self, n_layers, batch, n_kv, slots, head_dim, dtype, device=None,
               fetch_timeout_s: float | None = None):
    self.device = device or jax.devices()[0]
    self.on_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
    self.on_device_kv = self.on_device                           # the fetched [G, 2, B, K, X, H]
    shape = (batch, n_kv, slots, head_dim)
    self._kv = np.zeros((n_layers, 2) + shape, jnp.dtype(dtype))   # all layers' K and V: one gather per group
    self.k = [kv[0] for kv in self._kv]
    self.v = [kv[1] for kv in self._kv]
    self.fetch_timeout_s = resolve_fetch_timeout(fetch_timeout_s)
    self._worker = Worker("kv-host")
    self._failed_write = None      # (what, exception) of the first write that raised in the worker

  def _write(self, what: str, job):
    """Queue a write; one that raises is kept (every later fetch fails on it) and later writes are dropped."""
    def run():
      if self._failed_write is None:
        try:
          job()
        except Exception as e:           # noqa: BLE001 (re-raised by the next fetch, with its layer)
          self._failed_write = (what, e)
    self._worker.submit(run)

  def _raise_failed_write(self):
    if self._failed_write is not None:
      what, e = self._failed_write
      raise HostStoreError(f"the {what} failed earlier in the worker ({type(e).__name__}: {e}); the store "
                           "no longer holds every row") from e

  def write_prompt(self, layer, k_BTKH, v_BTKH, row0: int = 0):
    """The prompt's k/v [n, T, K, H] of sequences row0..row0+n-1, at positions 0..T-1."""
    _start_copies((k_BTKH, v_BTKH))
    def job():
      k, v = np.asarray(k_BTKH).swapaxes(1, 2), np.asarray(v_BTKH).swapaxes(1, 2)
      self.k[layer][row0:row0 + k.shape[0], :, :k.shape[2]] = k
      self.v[layer][row0:row0 + v.shape[0], :, :v.shape[2]] = v
    self._write(f"prompt write of layer {layer}", job)

  def write_block(self, layer, k_BKTH, v_BKTH, start_B, rows):
    """Batch rows `rows` (numpy ints) of k/v [B, K, T, H] at positions start_B[b] .. + T (numpy [B])."""
    _start_copies((k_BKTH, v_BKTH))
    def job():
      k, v = np.asarray(k_BKTH), np.asarray(v_BKTH)
      for b in rows:
        t = k.shape[2]
        self.k[layer][b, :, start_B[b]:start_B[b] + t] = k[b]
        self.v[layer][b, :, start_B[b]:start_B[b] + t] = v[b]
    self._write(f"block write of layer {layer}", job)

  def gather(self, layers: tuple[int, ...], kappas_BKX):
    """On the worker: consecutive `layers`' rows at their κ -> one [G, 2, B, K, X, H] device array."""
    idx = np.stack([np.asarray(k) for k in kappas_BKX])[:, None]                # [G, 1, B, K, X]
    rows = take_rows(self._kv[layers[0]:layers[-1] + 1], idx)                   # [G, 2, B, K, X, H]
    # a new array, never written again: on the CPU backend the device array may be it (no second copy of
    # the block, which slowed the step's compute: results/throughput_cpu.md); elsewhere a host -> device copy
    return jax.device_put(rows, self.on_device_kv, may_alias=True)

  def fetch(self, layers, kappas_BKX) -> PendingFetch:
    """Consecutive `layers`' rows at their κ [B, K, X] -> a pending fetch of one [G, 2, B, K, X, H] device array
    (item i: layer i's K and V rows): one gather and one transfer per group, on the worker thread."""
    layers = tuple(int(l) for l in layers)
    if list(layers) != list(range(layers[0], layers[0] + len(layers))) or len(kappas_BKX) != len(layers):
      raise ValueError(f"fetch needs consecutive layers with one κ each; got layers {layers} and "
                       f"{len(kappas_BKX)} κ arrays")
    _start_copies(kappas_BKX)
    def job():
      self._raise_failed_write()
      return self.gather(layers, kappas_BKX)
    return PendingFetch(self._worker.submit(job), layers, self.fetch_timeout_s, self._worker)

  def arrays(self):
    """The K/V arrays after every write queued so far (waits for the worker, as a fetch does)."""
    PendingFetch(self._worker.submit(self._raise_failed_write), (), self.fetch_timeout_s, self._worker).result()
    return self.k + self.v

  @property
  def nbytes(self) -> int:
    return int(self._kv.nbytes)

  def close(self):
    """Stop the worker after the jobs queued so far (at once, dropping them, when a fetch timed out)."""
    self._worker.shutdown()


# ----- the stores on a device mesh -----

class _MeshPlacement:
  """Host-store placement on a mesh: every block [B, K, ...] on ("data", "model"), row starts [B] on data."""

  def _place(self, mesh):
    self.mesh = mesh
    self.device = sharding.first_local_device(mesh)
    self.on_device = NamedSharding(mesh, P("data", "model", None, None), memory_kind="device")
    self.host = NamedSharding(mesh, P("data", "model", None, None), memory_kind="pinned_host")
    self.on_device_kv = NamedSharding(mesh, P(None, None, "data", "model", None, None), memory_kind="device")

  def _put_host(self, x):
    spec = sharding.layer_leaf_spec(x.shape, stacked=False)
    return jax.device_put(x, NamedSharding(self.mesh, spec, memory_kind="pinned_host"))


class MeshPinnedHostStore(_MeshPlacement, PinnedHostStore):
  """PinnedHostStore with its pinned_host K/V [B, K, S, H] sharded like the device cache."""

  def __init__(self, mesh, n_layers, batch, n_kv, slots, head_dim, dtype):
    self._place(mesh)
    shape = (batch, n_kv, slots, head_dim)
    self.k = [jax.device_put(np.zeros(shape, dtype), self.host) for _ in range(n_layers)]
    self.v = [jax.device_put(np.zeros(shape, dtype), self.host) for _ in range(n_layers)]


class MeshNumpyHostStore(_MeshPlacement, NumpyHostStore):
  """NumpyHostStore on a mesh: this process's RAM holds only its devices' blocks (rows on data x KV heads on
  model, one buffer per addressable device), written from the local shards and gathered per device into one
  [G, 2, B, K, X, H] array sharded on (data, model): nothing crosses processes."""

  def __init__(self, mesh, n_layers, batch, n_kv, slots, head_dim, dtype, fetch_timeout_s: float | None = None):
    NumpyHostStore.__init__(self, n_layers, 0, n_kv, slots, head_dim, dtype, sharding.first_local_device(mesh),
                            fetch_timeout_s)          # its worker, and no rows: the blocks below hold them
    self._place(mesh)
    self.global_shape = (batch, n_kv, slots, head_dim)
    index = self.on_device.addressable_devices_indices_map(self.global_shape)
    self.shards = []                   # (device, rows slice, KV heads slice, [L, 2, b, k, S, H] buffer)
    for device, idx in index.items():
      b, k = (slice(*sl.indices(n)[:2]) for sl, n in zip(idx[:2], (batch, n_kv)))
      shape = (n_layers, 2, b.stop - b.start, k.stop - k.start, slots, head_dim)
      self.shards.append((device, b, k, np.zeros(shape, jnp.dtype(dtype))))

  def write_prompt(self, layer, k_BTKH, v_BTKH, row0: int = 0):
    def job():
      n, t = k_BTKH.shape[:2]
      for _, b, k, buf in self.shards:
        lo, hi = max(b.start, row0), min(b.stop, row0 + n)
        if lo < hi:
          rows = slice(lo - row0, hi - row0)
          for i, x in enumerate((k_BTKH, v_BTKH)):
            buf[layer, i, lo - b.start:hi - b.start, :, :t] = sharding.local_block(x, rows, k, 2).swapaxes(1, 2)
    self._write(f"prompt write of layer {layer}", job)

  def write_block(self, layer, k_BKTH, v_BKTH, start_B, rows):
    def job():
      t = k_BKTH.shape[2]
      for _, b, k, buf in self.shards:
        mine = [int(r) for r in rows if b.start <= r < b.stop]
        if not mine:
          continue
        blocks = [sharding.local_block(x, b, k, 1) for x in (k_BKTH, v_BKTH)]
        for r in mine:
          for i, x in enumerate(blocks):
            buf[layer, i, r - b.start, :, start_B[r]:start_B[r] + t] = x[r - b.start]
    self._write(f"block write of layer {layer}", job)

  def gather(self, layers: tuple[int, ...], kappas_BKX):
    """On the worker: per addressable device, its rows at its κ -> one [G, 2, B, K, X, H] array on the mesh."""
    g, x = len(layers), kappas_BKX[0].shape[-1]
    parts = []
    for device, b, k, buf in self.shards:
      idx = np.stack([sharding.local_block(kappa, b, k, 1) for kappa in kappas_BKX])[:, None]   # [G, 1, b, k, X]
      rows = take_rows(buf[layers[0]:layers[-1] + 1], idx)
      parts.append(jax.device_put(rows, device, may_alias=True))
    shape = (g, 2, self.global_shape[0], self.global_shape[1], x, self.global_shape[3])
    return jax.make_array_from_single_device_arrays(shape, self.on_device_kv, parts)

  def arrays(self):
    """This process's blocks after the queued writes: per addressable device K [L, b, k, S, H], then V."""
    NumpyHostStore.arrays(self)
    return [buf[:, i] for i in (0, 1) for _, _, _, buf in self.shards]

  @property
  def nbytes(self) -> int:
    """Bytes this process holds (its devices' blocks)."""
    return int(sum(buf.nbytes for *_, buf in self.shards))


def make_store(kind: str, n_layers, batch, n_kv, slots, head_dim, dtype, device=None, mesh=None,
               fetch_timeout_s: float | None = None):
  """The host store of `kind` (`resolve_store_kind`: auto is numpy), laid out on `mesh` when given (each process
  then holds its own devices' blocks). fetch_timeout_s: the numpy store's limit on one wait for a fetch
  (`resolve_fetch_timeout`)."""
  kind = resolve_store_kind(kind)
  if mesh is not None:
    if kind == "pinned_host":
      return MeshPinnedHostStore(mesh, n_layers, batch, n_kv, slots, head_dim, dtype)
    store = MeshNumpyHostStore(mesh, n_layers, batch, n_kv, slots, head_dim, dtype, fetch_timeout_s)
    multiprocess.close_at_shutdown(store)
    return store
  device = device or jax.local_devices()[0]
  if kind == "pinned_host":
    return PinnedHostStore(n_layers, batch, n_kv, slots, head_dim, dtype, device)
  return NumpyHostStore(n_layers, batch, n_kv, slots, head_dim, dtype, device, fetch_timeout_s)
