"""Timing helpers: warm up, block on results, medians; and what the machine was doing meanwhile."""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np


def block(tree):
  """Wait for every array in a pytree (other leaves are ignored); returns the tree."""
  jax.block_until_ready([x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)])
  return tree


def summarize(samples_s) -> dict[str, Any]:
  """Seconds per call -> {median_s, min_s, max_s, mean_s, n, samples_s}."""
  xs = [float(x) for x in samples_s]
  if not xs:
    raise ValueError("summarize needs at least one sample")
  return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs),
          "mean_s": statistics.fmean(xs), "n": len(xs), "samples_s": [round(x, 6) for x in xs]}


def time_calls(fn: Callable[[], Any], warmup: int, iters: int) -> dict[str, Any]:
  """Call `fn()` `warmup` times untimed, then `iters` times, each timed separately and blocked on."""
  if iters < 1 or warmup < 0:
    raise ValueError(f"{iters=} must be >= 1 and {warmup=} >= 0")
  for _ in range(warmup):
    block(fn())
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    block(fn())
    samples.append(time.perf_counter() - t0)
  return summarize(samples)


def time_chain(step: Callable[[Any], Any], carry, warmup: int, iters: int, sync=None):
  """Run `carry = step(carry)` `warmup` times, then `iters` times back to back (asynchronous dispatch may
  pipeline consecutive calls) and block only at the end. `sync(carry)` names what to wait for (default: the
  whole carry). Returns (seconds per step, carry)."""
  if iters < 1 or warmup < 0:
    raise ValueError(f"{iters=} must be >= 1 and {warmup=} >= 0")
  sync = sync or (lambda c: c)
  for _ in range(warmup):
    carry = step(carry)
  block(sync(carry))
  t0 = time.perf_counter()
  for _ in range(iters):
    carry = step(carry)
  block(sync(carry))
  return (time.perf_counter() - t0) / iters, carry


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  """(seconds, result) of one blocked call."""
  t0 = time.perf_counter()
  out = block(fn())
  return time.perf_counter() - t0, out


def load_average() -> list[float]:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return []


def machine_info() -> dict[str, Any]:
  """Where and under which load a benchmark ran (recorded in every result file)."""
  dev = jax.devices()[0]
  return {
      "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
      "host": platform.node(),
      "python": platform.python_version(),
      "cpu_count": os.cpu_count(),
      "load_average_1_5_15": load_average(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
      "num_devices": jax.device_count(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "numpy": np.__version__,
  }


def ratio(a: float | None, b: float | None) -> float | None:
  """a / b, or None when either is missing or b is zero."""
  if a is None or b is None or b == 0:
    return None
  return float(a) / float(b)


def add_ratios(cell: dict, reference: str, keys: Sequence[str], *, measured: str,
               value: Callable[[dict, str], Any] = lambda rec, key: rec.get(key)) -> None:
  """rec[key + "_ratio"] = value(rec, key) / value(reference's rec, key) for each key, in every method record of
  the cell that has `measured` (the others were skipped); None where the reference has no value."""
  ref = cell["methods"].get(reference, {})
  for rec in cell["methods"].values():
    if measured in rec:
      for key in keys:
        rec[key + "_ratio"] = ratio(value(rec, key), value(ref, key))
