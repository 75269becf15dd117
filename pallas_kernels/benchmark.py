"""Kernel vs reference: a correctness check, then (on a GPU) timings and achieved bandwidth.

`run(...)` is what `experiments/kernel_bench.py` calls. Every shape is checked against the float32 reference
before it is timed. Bytes moved are the bytes a kernel must touch at least: its inputs (the packed codes, the
scales and zeros of the valid slots, q, the 16-bit extra rows) and its outputs; achieved bandwidth =
bytes / median time, compared with the card's peak (H200: about 4.8 TB/s). The reference is timed on the same
inputs; it dequantizes the whole cache in HBM, so its bytes are larger than the ones counted here.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import testing
from pallas_kernels.mixed_decode_attention import MixedAttentionBlock
from pallas_kernels.mixed_decode_attention import mixed_decode_attention
from pallas_kernels.mixed_decode_attention import mixed_decode_attention_reference
from pallas_kernels.quant_scores import QuantScoresBlock
from pallas_kernels.quant_scores import quant_scores
from pallas_kernels.quant_scores import quant_scores_reference

H200_BYTES_PER_S = 4.8e12


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmark shape (axis letters as in docs/design.md); X excluded slots, E extra 16-bit columns."""
  batch: int = 4          # B
  t: int = 2              # T: real + speculative row
  kv_heads: int = 8       # K
  gqa: int = 4            # G
  slots: int = 32768      # S
  head_dim: int = 128     # H
  group_size: int = 32    # g
  n_exclude: int = 64     # X: fetched κ rows
  n_extra: int = 130      # E: κ rows + residual window (64) + the 2 new tokens


SMALL = Shape(batch=2, kv_heads=2, gqa=3, slots=200, head_dim=64, n_exclude=5, n_extra=9)


def _itemsize(x) -> int:
  return x.size * x.dtype.itemsize


def bytes_moved(op: str, args, shape: Shape) -> int:
  """Least bytes `op` reads and writes (counts every slot: time it with all lengths = S)."""
  if op == "quant_scores":
    q, codes, scale, zero, _ = args
    out = shape.batch * shape.kv_heads * shape.gqa * shape.t * shape.slots * 4
    return _itemsize(q) + _itemsize(codes) + _itemsize(scale) + _itemsize(zero) + out
  q, kc, ks, kz, vc, vs, vz, _, excl, ek, ev, em = args
  probs = shape.batch * shape.kv_heads * (shape.slots + shape.n_extra) * 4
  return sum(_itemsize(x) for x in (q, kc, ks, kz, vc, vs, vz, excl, ek, ev, em)) + _itemsize(q) + probs


def make_inputs(op: str, shape: Shape, bits: int, dtype, *, ragged: bool, seed: int = 0):
  """Seeded inputs; ragged: row 0 full, the others shorter (poisoned past their length), else all full."""
  lengths = [shape.slots] * shape.batch
  if ragged:
    lengths[1:] = [shape.slots * (i + 1) // (shape.batch + 1) + 3 for i in range(shape.batch - 1)]
  common = dict(batch=shape.batch, t=shape.t, kv_heads=shape.kv_heads, gqa=shape.gqa, slots=shape.slots,
                head_dim=shape.head_dim, bits=bits, group_size=shape.group_size, lengths=lengths,
                dtype=dtype, poison=ragged)
  if op == "quant_scores":
    return testing.quant_scores_inputs(seed, **common)
  return testing.mixed_inputs(seed, n_exclude=shape.n_exclude, n_extra=shape.n_extra, **common)


def _functions(op: str, bits: int, shape: Shape, interpret: bool, block):
  kw = dict(bits=bits, group_size=shape.group_size, sm_scale=shape.head_dim ** -0.5)
  if op == "quant_scores":
    return (functools.partial(quant_scores, **kw, interpret=interpret, block=block),
            functools.partial(quant_scores_reference, **kw))
  return (functools.partial(mixed_decode_attention, **kw, interpret=interpret, block=block),
          functools.partial(mixed_decode_attention_reference, **kw))


def max_errors(got, want) -> float:
  """Largest |got - want| / max(1, max |want|) over the outputs; -inf entries must match by position
  (a mismatch or a NaN gives inf)."""
  worst = 0.0
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if np.isnan(g).any() or (np.isneginf(g) != np.isneginf(w)).any():
      return float("inf")
    finite = np.isfinite(w)
    scale = max(1.0, float(np.abs(w[finite]).max(initial=0.0)))
    worst = max(worst, float(np.abs(g[finite] - w[finite]).max(initial=0.0)) / scale)
  return worst


def _median_seconds(fn, args, iters: int) -> float:
  jax.block_until_ready(fn(*args))                       # compile and warm up
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def run(*, bits_list=(1, 2), iters: int = 20, shape: Shape = Shape(), tolerance: float = 2e-2) -> dict:
  """Checks both ops on SMALL (interpret mode off a GPU); on a GPU also checks and times `shape`."""
  on_gpu = jax.default_backend() == "gpu"
  report = dict(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                mode="gpu: compiled kernels checked and timed" if on_gpu else
                "cpu: interpret-mode correctness check on a small shape only; no timings",
                checks=[], timings=[])
  blocks = dict(quant_scores=QuantScoresBlock(block_s=64 if on_gpu else 32),
                mixed=MixedAttentionBlock(block_s=64 if on_gpu else 32, num_splits=3))
  shapes = [("small", SMALL, jnp.float32)] + ([("realistic", shape, jnp.bfloat16)] if on_gpu else [])
  for label, shp, dtype in shapes:
    for bits in bits_list:
      for op in ("quant_scores", "mixed"):
        block = blocks[op] if label == "small" else None
        kernel, reference = _functions(op, bits, shp, not on_gpu, block)
        args = make_inputs(op, shp, bits, dtype, ragged=label == "small")
        err = max_errors(jax.jit(kernel)(*args), jax.jit(reference)(*args))
        ok = err <= (1e-4 if dtype == jnp.float32 else tolerance)
        report["checks"].append(dict(op=op, shape=label, bits=bits, dtype=jnp.dtype(dtype).name,
                                     max_scaled_error=err, ok=ok))
        if not ok:
          raise AssertionError(f"{op} {label} {bits=}: kernel differs from reference by {err}")
        if label != "realistic":
          continue
        n_bytes = bytes_moved(op, args, shp)
        t_kernel = _median_seconds(jax.jit(kernel), args, iters)
        t_ref = _median_seconds(jax.jit(reference), args, iters)
        report["timings"].append(dict(
            op=op, bits=bits, shape=dataclasses.asdict(shp), dtype=jnp.dtype(dtype).name, bytes=n_bytes,
            kernel_s=t_kernel, reference_s=t_ref, speedup=t_ref / t_kernel,
            kernel_bytes_per_s=n_bytes / t_kernel, kernel_fraction_of_h200_peak=n_bytes / t_kernel /
            H200_BYTES_PER_S, reference_bytes_per_s=n_bytes / t_ref))
  return report
