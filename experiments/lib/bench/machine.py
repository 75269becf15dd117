"""What the machine can do, measured in the run that uses it: memory read bandwidth and fp32 matmul FLOP/s.

A decode step must at least read the weights and the cache it attends, so `bytes / read bandwidth` is its floor;
a prefill is compute-bound, so `FLOPs / matmul FLOP/s` is its floor. Each is measured with every framework the
benchmark times (numpy with one thread per core, torch with its configured threads, jitted JAX on the default
device) and the best of them is the machine's figure: a method cannot beat the fastest way this machine reads.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def cpu_threads() -> int:
  """The cores this process may run on (XLA's CPU thread pool is sized to this)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:                                      # not Linux
    return os.cpu_count() or 1


def _best_of(fn, repeats: int) -> float:
  fn()                                                        # warm-up (compiles, faults pages in)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def _numpy_threaded_sum(x: np.ndarray, threads: int) -> float:
  """Sum of a flat array in `threads` contiguous chunks at once (numpy releases the GIL inside a reduction)."""
  chunks = np.array_split(x, threads)
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return float(sum(pool.map(np.sum, chunks)))


def read_bandwidth(nbytes: int, threads: int, repeats: int = 5, torch_device: str | None = "cpu") -> dict[str, Any]:
  """Bytes per second of a float32 sum over an `nbytes` array: numpy (threaded), torch, jitted JAX.

  `best_Bps` is the fastest of those that read memory of the device the decode runs on (all of them on a CPU
  backend; JAX and torch-on-`torch_device` otherwise)."""
  n = int(nbytes) // 4
  if n < threads:
    raise ValueError(f"{nbytes=} is too small to split over {threads=}")
  host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
  out: dict[str, Any] = {"bytes": n * 4, "threads": threads, "repeats": repeats}
  cpu = jax.default_backend() == "cpu"
  if cpu:
    out["numpy_threads_Bps"] = n * 4 / _best_of(lambda: _numpy_threaded_sum(host, threads), repeats)
  if torch_device:
    import torch
    xt = torch.from_numpy(host).to(torch_device)
    sync = (lambda: torch.cuda.synchronize()) if xt.is_cuda else (lambda: None)
    out["torch_Bps"] = n * 4 / _best_of(lambda: (xt.sum().item(), sync()), repeats)
    out["torch_device"] = torch_device
    del xt
  xj = jax.device_put(host)
  del host
  total = jax.jit(lambda x: jnp.sum(x.reshape(threads * 64, -1) if n % (threads * 64) == 0 else x))
  out["jax_Bps"] = n * 4 / _best_of(lambda: float(total(xj)), repeats)
  del xj
  keys = [k for k in ("numpy_threads_Bps", "torch_Bps", "jax_Bps") if k in out]
  if not cpu:
    keys = ["jax_Bps"] + (["torch_Bps"] if torch_device and torch_device != "cpu" else [])
  out["best_Bps"] = max(out[k] for k in keys)
  out["best_of"] = keys
  return out


def matmul_flops(n: int, repeats: int = 3, torch_device: str | None = "cpu") -> dict[str, Any]:
  """FLOP/s of an fp32 [n, n] x [n, n] GEMM (2·n³ FLOPs): jitted JAX and torch; `best_flops` the faster."""
  flops = 2.0 * n ** 3
  rs = np.random.default_rng(1)
  a, b = (rs.standard_normal((n, n), dtype=np.float32) for _ in range(2))
  out: dict[str, Any] = {"n": n, "dtype": "float32", "repeats": repeats}
  aj, bj = jax.device_put(a), jax.device_put(b)
  mm = jax.jit(jnp.matmul)
  out["jax_flops"] = flops / _best_of(lambda: mm(aj, bj).block_until_ready(), repeats)
  keys = ["jax_flops"]
  if torch_device:
    import torch
    at, bt = torch.from_numpy(a).to(torch_device), torch.from_numpy(b).to(torch_device)
    sync = (lambda: torch.cuda.synchronize()) if at.is_cuda else (lambda: None)
    out["torch_flops"] = flops / _best_of(lambda: (torch.matmul(at, bt), sync()), repeats)
    keys.append("torch_flops")
  out["best_flops"] = max(out[k] for k in keys)
  return out


def measure(bandwidth_bytes: int, gemm_n: int, threads: int, torch_device: str | None = "cpu",
            repeats: int = 5) -> dict[str, Any]:
  """Both limits, plus the thread counts they ran with."""
  out: dict[str, Any] = {"jax_cpu_threads": cpu_threads(), "backend": jax.default_backend()}
  if torch_device:
    import torch
    out["torch_threads"] = torch.get_num_threads()
  t0 = time.perf_counter()
  out["read_bandwidth"] = read_bandwidth(bandwidth_bytes, threads, repeats, torch_device)
  out["matmul"] = matmul_flops(gemm_n, max(repeats // 2, 1), torch_device)
  out["seconds"] = time.perf_counter() - t0
  return out
