"""Hand-written XLA:CPU kernels (XLA FFI custom calls), each beside its float32 jnp reference.

`skinny_matmul(x [M, D], w)`: a weight product with few rows (M <= MAX_ROWS), the shape of every projection in a
decoding step. XLA:CPU's dot streams a weight matrix at memory bandwidth for one row, but takes ~1.65x as long
for two (measured on the 2-core AVX-512 machine for [576, 1536] float32; numpy and torch behave alike), and a
SpeCache step decodes two rows per sequence (the real and the speculative token). The kernel reads each weight
once for all M rows (`skinny_matmul.cc`).

`mixed_attention.mixed_decode_attention`: the low-bit + 16-bit decode attention of SpeCache and KIVI with the
contract of the Pallas kernel of that name (`mixed_attention.cc`; its own module, this one is the loader).

`select.top_k_indices` / `select.scatter_top_k` / `select.take_rows` / `select.argmax`: SpeCache's κ choice
(lax.top_k's indices, exactly; the second from the attention's two probability parts), the κ rows' gather and the
greedy token (jnp.argmax's index, exactly) (`select.cc`).

`prefill_attention.causal_attention`: the prompt's causal attention (`prefill_attention.cc`), register-tiled.

`dense_attention.decode_attention`: the full cache's decoding attention over a dense float32 cache
(`dense_attention.cc`), chunks of slots with an online softmax, reading only the attended slots.

`ring_keys.ring_keys`: the low-bit cache's ring as key columns (16-bit rows, or the last flushed window's rows
dequantized) for KIVI's and SpeCache's attention (`ring_keys.cc`).

The C++ sources are compiled once per host kind (`setup.sh` does it; otherwise the first use), into one library,
with the machine's C++ compiler (`-O3 -march=native -Wall`) against the XLA FFI headers of the installed jaxlib,
into a cache folder (`$SPECACHE_JAX_KERNEL_CACHE`, default `~/.cache/specache_jax/kernels`) keyed by the sources,
the jaxlib version, the compiler and the CPU (`build.py`: a library built for another CPU, altered or not
loadable is rebuilt, never loaded). Where that fails (no compiler) the models keep XLA's ops and `status()` says
why; `SPECACHE_JAX_CPU_KERNELS=0` turns the kernels off. They run on the CPU backend only: their callers lower to
XLA's ops for every other platform (`specache_jax.dispatch` chooses, by `lax.platform_dependent`; `dense`:
`dispatch.dense`).

Multi-device CPU meshes: `dense` wraps the call in `custom_partitioning` — the rows keep their sharding (each
device multiplies its own rows), the weights are gathered where they are sharded (correct; the per-device
weight bytes of a model-sharded layer are lost, acceptable for CPU meshes, which are a test bed here).
"""
from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from specache_jax.cpu_kernels import build as native

MAX_ROWS = 8          # rows the kernel takes
# Rows for which `dense` takes the kernel (`use_kernel`), by weight layout: [D, N] and a tied head's [N, D].
DENSE_ROWS = {"dn": (1, 8), "nd": (1, 8)}
TARGET = "specache_skinny_matmul"
ATTENTION_TARGET = "specache_mixed_decode_attention"
TOP_K_TARGET = "specache_top_k"
TAKE_ROWS_TARGET = "specache_take_rows"
ARGMAX_TARGET = "specache_argmax"
SCATTER_TOP_K_TARGET = "specache_scatter_top_k"
PREFILL_TARGET = "specache_prefill_attention"
DENSE_TARGET = "specache_dense_decode_attention"
RING_KEYS_TARGET = "specache_ring_keys"
ENV_SWITCH = "SPECACHE_JAX_CPU_KERNELS"


@functools.cache
def _load() -> tuple[bool, str]:
  if os.environ.get(ENV_SWITCH, "1") == "0":
    return False, f"off ({ENV_SWITCH}=0)"
  try:
    handle, lib = native.load()
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.SkinnyMatmul), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(handle.MixedDecodeAttention), platform="cpu")
    jax.ffi.register_ffi_target(TOP_K_TARGET, jax.ffi.pycapsule(handle.SelectTopK), platform="cpu")
    jax.ffi.register_ffi_target(TAKE_ROWS_TARGET, jax.ffi.pycapsule(handle.SelectTakeRows), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(handle.SelectArgMax), platform="cpu")
    jax.ffi.register_ffi_target(SCATTER_TOP_K_TARGET, jax.ffi.pycapsule(handle.SelectScatterTopK),
                                platform="cpu")
    jax.ffi.register_ffi_target(PREFILL_TARGET, jax.ffi.pycapsule(handle.PrefillAttention), platform="cpu")
    jax.ffi.register_ffi_target(DENSE_TARGET, jax.ffi.pycapsule(handle.DenseDecodeAttention), platform="cpu")
    jax.ffi.register_ffi_target(RING_KEYS_TARGET, jax.ffi.pycapsule(handle.RingKeysHandler), platform="cpu")
  except (RuntimeError, OSError) as e:
    return False, f"unavailable: {e}"
  return True, f"on ({lib})"


@contextlib.contextmanager
def disabled():
  """Within: the kernels count as off (`SPECACHE_JAX_CPU_KERNELS=0`), so programs traced here hold only XLA's ops
  on every platform (an export for another platform needs no CPU kernel, and jax >= 0.11 refuses the
  `custom_partitioning` of `dense` under the abstract mesh a GPU export lowers with)."""
  before = os.environ.get(ENV_SWITCH)
  os.environ[ENV_SWITCH] = "0"
  _load.cache_clear()
  try:
    yield
  finally:
    if before is None:
      os.environ.pop(ENV_SWITCH, None)
    else:
      os.environ[ENV_SWITCH] = before
    _load.cache_clear()


def available() -> bool:
  """Whether the kernels are built and registered (compiles them on the first call)."""
  return _load()[0]


def status() -> str:
  """'on (<library>)', 'off (...)' or 'unavailable: <why>'."""
  return _load()[1]


def _checked(x_MD, ws, transposed: bool) -> list[int]:
  """The output widths N_i of x [M, D] times each weight; a clear error for anything the kernel cannot take."""
  if not ws:
    raise ValueError("skinny_matmul: no weights given")
  m, d = x_MD.shape
  if not 1 <= m <= MAX_ROWS:
    raise ValueError(f"skinny_matmul: x has {m} rows; the kernel takes 1 to {MAX_ROWS}")
  if x_MD.dtype != jnp.float32 or any(w.dtype != jnp.float32 for w in ws):
    raise ValueError(f"skinny_matmul: float32 only, got x {x_MD.dtype} and w {[str(w.dtype) for w in ws]}")
  widths = []
  for w in ws:
    n, d_w = (w.shape if transposed else w.shape[::-1])
    if d_w != d:
      raise ValueError(f"skinny_matmul: x {x_MD.shape} and w {w.shape} (transposed={transposed}) do not contract")
    widths.append(n)
  return widths


def skinny_matmul(x_MD, ws, transposed: bool = False) -> list:
  """x [M, D] float32 (1 <= M <= MAX_ROWS) times each weight of `ws` -> a list of [M, N_i] float32, in one call
  (the weights' blocks share the threads). A weight is [D, N_i], or [N_i, D] when `transposed` (a tied LM head:
  x · wᵀ). CPU backend only; `skinny_matmul_reference` is the same in jnp."""
  widths = _checked(x_MD, ws, transposed)
  if not available():
    raise RuntimeError(f"skinny_matmul: CPU kernels {status()}")
  outs = [jax.ShapeDtypeStruct((x_MD.shape[0], n), jnp.float32) for n in widths]
  return list(jax.ffi.ffi_call(TARGET, outs, vmap_method="sequential")(x_MD, *ws, nd=transposed))


def skinny_matmul_reference(x_MD, ws, transposed: bool = False) -> list:
  """`skinny_matmul` in float32 jnp (the same signature)."""
  _checked(x_MD, ws, transposed)
  spec = "md,nd->mn" if transposed else "md,dn->mn"
  return [jnp.einsum(spec, x_MD, w, precision=jax.lax.Precision.HIGHEST) for w in ws]


def use_kernel(rows: int, transposed: bool) -> bool:
  """Whether `dense` takes the kernel for a product with `rows` rows (`DENSE_ROWS`), from whole decoding steps
  with the kernels on and off (SmolLM2-135M shapes, the 2-core AVX-512 CPU): every weight product from 1 to 8
  rows. One row: XLA's dot was as fast until the kernel stopped oversubscribing the cores and prefetched its rows
  (2026-12-05: the full-cache step at 1k, batch 1, 28.6 ms with XLA's dot, 22.4 ms with the kernel; the weight
  products alone 22.9 vs 19.4 ms, where summing every weight once takes 18.8 ms). 8 rows, SpeCache at batch 4:
  every weight product of a step 28 ms vs XLA's 38 ms."""
  lo, hi = DENSE_ROWS["nd" if transposed else "dn"]
  return lo <= rows <= hi


def dense_applies(x, ws, transposed: bool = False) -> bool:
  """Whether `dense_kernel` takes x [..., D] times `ws`: float32 operands with few rows (`use_kernel`: a decoding
  step) and the kernels built."""
  rows = x.size // x.shape[-1] if x.shape[-1] else 0
  f32 = x.dtype == jnp.float32 and all(w.dtype == jnp.float32 for w in ws)
  return use_kernel(rows, transposed) and f32 and available()


def dense_kernel(x, *ws, transposed: bool = False) -> tuple:
  """x [..., D] times each weight [D, N_i] (or [N_i, D] when `transposed`) -> a tuple of [..., N_i], by
  `skinny_matmul` (one call for all the weights; the rows keep their sharding on a CPU mesh)."""
  rows = x.size // x.shape[-1]
  outs = _row_partitioned(len(ws), transposed)(x.reshape(rows, x.shape[-1]), *ws)
  return tuple(y.reshape(x.shape[:-1] + (y.shape[-1],)) for y in outs)


def dense_reference(x, *ws, transposed: bool = False) -> tuple:
  """`dense_kernel` as XLA's dots."""
  spec = "...d,nd->...n" if transposed else "...d,dn->...n"
  return tuple(jnp.einsum(spec, x, w) for w in ws)


@functools.cache
def _row_partitioned(n_weights: int, transposed: bool):
  """`skinny_matmul` for the SPMD partitioner: rows keep their sharding, weights and outputs' columns are
  replicated (each device multiplies its rows by the whole weights)."""
  names = [f"n{i}" for i in range(n_weights)]
  rule = ", ".join(["m d"] + [f"{n} d" if transposed else f"d {n}" for n in names]) + " -> " + ", ".join(
      f"m {n}" for n in names)

  local = lambda x, *ws: tuple(skinny_matmul(x, ws, transposed))   # noqa: E731 (also each device's part)
  call = custom_partitioning(local)

  def shardings(mesh, x_shape):
    spec = x_shape.sharding.spec if isinstance(x_shape.sharding, NamedSharding) else P()
    rows = NamedSharding(mesh, P(spec[0] if len(spec) else None, None))
    return rows, NamedSharding(mesh, P())

  def infer(mesh, arg_shapes, result_shape):
    return tuple(shardings(mesh, arg_shapes[0])[0] for _ in range(n_weights))

  def partition(mesh, arg_shapes, result_shape):
    rows, whole = shardings(mesh, arg_shapes[0])
    return mesh, local, tuple(rows for _ in range(n_weights)), (rows,) + (whole,) * n_weights

  call.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=("d", *names))
  return call


def batch_partitioned(local, rule: str, n_results: int, replicated: tuple[str, ...]):
  """`local` (a function of arrays whose leading axis is the batch) wrapped in `custom_partitioning` for the
  SPMD partitioner: every operand's and result's leading axis takes the first operand's sharding of it, every
  other axis is gathered (each device runs the kernel on its own sequences). rule: the Shardy einsum-like rule
  ("b s, b x -> b x"); replicated: its factors other than the leading one."""
  call = custom_partitioning(local)

  def batch_sharding(mesh, shape):
    spec = shape.sharding.spec if isinstance(shape.sharding, NamedSharding) else P()
    return NamedSharding(mesh, P(spec[0] if len(spec) else None))

  def infer(mesh, arg_shapes, result_shape):
    rows = batch_sharding(mesh, arg_shapes[0])
    return (rows,) * n_results if n_results > 1 else rows

  def partition(mesh, arg_shapes, result_shape):
    rows = batch_sharding(mesh, arg_shapes[0])
    return mesh, local, (rows,) * n_results if n_results > 1 else rows, (rows,) * len(arg_shapes)

  call.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=replicated)
  return call
