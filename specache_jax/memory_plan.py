"""The up-front memory plan of the offloaded runtime: what must fit on the accelerator (weights, the method's
device state, one prefill chunk's activations) and in host memory (the 16-bit store), checked before anything is
allocated (`plan_memory`, `MemoryPlan.check`). Sizes come from shapes alone (`jax.eval_shape`)."""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from specache_jax.arrays import tree_nbytes
from specache_jax.caches.attention import PrefillBlocks
from specache_jax.caches.base import HOST_STORES
from specache_jax.model.decoder import ROW_CHUNK


def resolve_store_kind(kind: str) -> str:
  if kind not in HOST_STORES:
    raise ValueError(f"host_store={kind!r} must be one of {HOST_STORES}")
  # auto = the host-worker store everywhere: its gathers and writes never enter the device's compute stream
  # (pinned_host's host programs queue behind layer l on a GPU, where device code also cannot index pinned_host
  # arrays, jax#34041), and on this CPU it is the faster one too (SmolLM2 shapes, S=8192, B=1: 111 vs 119 ms per
  # offloaded step). pinned_host stays available by name.
  return "numpy" if kind == "auto" else kind


class MemoryPlanError(ValueError):
  """A run that cannot fit, with the numbers (needed vs available)."""


def _host_available_bytes() -> int:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _device_available_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return None


PINNED_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"   # XLA's GPU client caps its pinned host pool (GiB)
PINNED_LIMIT_DEFAULT_GIB = 64


def pinned_limit_bytes(platform: str) -> int | None:
  """The pinned host pool a `pinned_host` store allocates from: on GPU, XLA's cap ($XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB,
  64 GiB by default); elsewhere no separate cap (None)."""
  if platform not in ("gpu", "cuda", "rocm"):
    return None
  raw = os.environ.get(PINNED_LIMIT_ENV, "")
  try:
    gib = float(raw) if raw else PINNED_LIMIT_DEFAULT_GIB
  except ValueError:
    raise MemoryPlanError(f"{PINNED_LIMIT_ENV}={raw!r} must be a number of GiB") from None
  return int(gib * 2**30)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  device_bytes: int            # weights + device cache state + activation peak
  host_bytes: int              # the complete 16-bit cache
  device_available: int | None
  host_available: int
  shared_memory: bool          # CPU backend: "device" and host are the same RAM
  store: str = "numpy"         # the host store's kind (resolve_store_kind): where host_bytes live
  pinned_limit: int | None = None   # the pinned pool's cap when the store is pinned_host (GPU), else None
  prefill_rows: int = 0        # sequences prefilled at a time (the runtime's batch chunks); 0: not planned
  activation_bytes: int = 0    # of device_bytes: the prefill activations of prefill_rows sequences

  def check(self) -> None:
    gib = lambda n: f"{n / 2**30:.2f} GiB"
    if self.shared_memory:
      need = self.device_bytes + self.host_bytes
      if need > self.host_available:
        raise MemoryPlanError(f"the run needs {gib(need)} (device {gib(self.device_bytes)} + host "
                              f"{gib(self.host_bytes)}) but only {gib(self.host_available)} of RAM is available")
      return
    if self.device_available is not None and self.device_bytes > self.device_available:
      part = (f" (of which the prefill's activations for {self.prefill_rows} sequence(s) at a time: "
              f"{gib(self.activation_bytes)})" if self.prefill_rows else "")
      raise MemoryPlanError(f"the run needs {gib(self.device_bytes)} of accelerator memory{part} but only "
                            f"{gib(self.device_available)} is available")
    if self.host_bytes > self.host_available:
      raise MemoryPlanError(f"the 16-bit cache needs {gib(self.host_bytes)} of host memory but only "
                            f"{gib(self.host_available)} is available")
    if self.store == "pinned_host" and self.pinned_limit is not None and self.host_bytes > self.pinned_limit:
      raise MemoryPlanError(
          f"the 16-bit cache needs {gib(self.host_bytes)} of pinned host memory but XLA's pinned pool is capped "
          f"at {gib(self.pinned_limit)} (raise {PINNED_LIMIT_ENV}, up to the {gib(self.host_available)} "
          f"available, or use host_store='numpy', which keeps the cache in pageable RAM)")


def prefill_activation_bytes(model_cfg, batch: int, prompt_len: int, dtype,
                             blocks: PrefillBlocks = PrefillBlocks()) -> int:
  """Peak transient bytes of one prefill layer as it is computed (the largest phase; layers run one at a time):

    every prompt row holds  x in and out, q, k, v (dtype) + float32 q, keys, values and attention output of
                            the blockwise attention (caches/attention.prefill_attention);
    one row piece           the SwiGLU's gate, up and product for ROW_CHUNK rows (decoder.in_row_chunks), f32;
    one attention tile      logits, probabilities and mask of block_q·G rows x block_k keys per KV head, f32;
  plus the last row's logits (f32, a few copies). An upper bound on what XLA:CPU allocates (checked against
  its memory analysis in tests/test_offload.py); not checked against a GPU compilation (none here)."""
  c, item = model_cfg, jnp.dtype(dtype).itemsize
  q_width, kv_width = c.n_heads * c.head_dim, 2 * c.n_kv_heads * c.head_dim
  rows = batch * prompt_len
  per_row = (2 * c.dim + q_width + kv_width) * item + (2 * q_width + kv_width) * 4
  piece = min(rows, ROW_CHUNK) * 3 * c.ffn_dim * 4
  tile = batch * c.n_kv_heads * min(prompt_len, blocks.block_q) * (c.n_heads // c.n_kv_heads) * \
      min(prompt_len, blocks.block_k) * 4 * 3
  return int(rows * per_row + piece + tile + batch * c.vocab_size * 4 * 4)


@functools.lru_cache(maxsize=64)
def _state_bytes(model_cfg, method, batch: int, max_len: int, dtype) -> int:
  """Bytes of the method's state (from its shapes: a trace, kept per shape so a repeated plan traces nothing)."""
  return tree_nbytes(jax.eval_shape(lambda: method.impl.init(method, model_cfg, batch, max_len, dtype)))


def plan_memory(model_cfg, method, params, batch: int, max_len: int, dtype, prompt_len: int,
                device=None, host_available: int | None = None, device_available: int | None = None,
                platform: str | None = None, pinned_limit: int | None = None,
                prefill_rows: int | None = None) -> MemoryPlan:
  """Sizes from shapes alone (jax.eval_shape; `params` may be ShapeDtypeStructs), computed before anything is
  allocated. platform / pinned_limit: default from `device` and the environment (override to plan for a
  machine other than this one). prefill_rows: sequences the runtime prefills at a time; None picks the most
  (up to `batch`) whose activations fit the accelerator next to the weights and the cache (all of them when
  its free memory is unknown or shared with the host), at least 1 — `check` then refuses a run that does not
  fit even one at a time. Any cache method may be planned: one that is not offloaded keeps its whole state on the
  device (host_bytes 0)."""
  device = device or jax.local_devices()[0]
  if device.process_index != jax.process_index():         # another process's: its memory cannot be queried
    device = jax.local_devices()[0]
  platform = platform or device.platform
  nbytes = tree_nbytes
  resident = nbytes(params) + _state_bytes(model_cfg, method, batch, max_len, jnp.dtype(dtype))
  host = 2 * model_cfg.n_layers * batch * model_cfg.n_kv_heads * method.slots(max_len) * model_cfg.head_dim * \
      jnp.dtype(dtype).itemsize if method.offload else 0        # not offloaded: the whole state is on the device
  device_available = device_available if device_available is not None else _device_available_bytes(device)
  shared = platform == "cpu"
  act = lambda rows: int(prefill_activation_bytes(model_cfg, rows, prompt_len, dtype))
  if prefill_rows is None:
    prefill_rows = batch
    if device_available is not None and not shared:
      while prefill_rows > 1 and resident + act(prefill_rows) > device_available:
        prefill_rows -= 1
  elif isinstance(prefill_rows, bool) or not isinstance(prefill_rows, int) or not 1 <= prefill_rows <= batch:
    raise ValueError(f"prefill_rows={prefill_rows!r} must be an int in [1, batch={batch}]")
  return MemoryPlan(
      device_bytes=resident + act(prefill_rows), host_bytes=int(host), device_available=device_available,
      host_available=host_available if host_available is not None else _host_available_bytes(),
      shared_memory=shared, store=resolve_store_kind(getattr(method, "host_store", "auto")),
      pinned_limit=pinned_limit if pinned_limit is not None else pinned_limit_bytes(platform),
      prefill_rows=prefill_rows, activation_bytes=act(prefill_rows))
