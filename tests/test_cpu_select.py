"""The XLA:CPU selection kernels (`cpu_kernels.select`: top-k indices, row gather, argmax) against their jnp
references (lax.top_k's exact indices and order; take_along_axis; jnp.argmax), and SpeCache's κ and the greedy
token through them."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import cpu_kernels as ck
from specache_jax.caches import attention as A
from specache_jax.caches import selection
from specache_jax.caches import specache as sc
from specache_jax.cpu_kernels import select

needs_kernel = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels {ck.status()}")


def _rows(kind: str, rng, n: int, s: int) -> np.ndarray:
  if kind == "normal":
    return rng.randn(n, s).astype(np.float32)
  if kind == "ties":                                          # a few distinct values: ties decide the order
    return rng.randint(0, 4, (n, s)).astype(np.float32)
  if kind == "special":                      # XLA's total order: -NaN < -inf < -0.0 < +0.0 < +inf < NaN
    x = rng.randn(n, s).astype(np.float32)
    for start, step, v in ((0, 7, np.nan), (1, 5, -np.nan), (2, 9, np.inf), (3, 11, -0.0), (4, 13, 0.0),
                           (5, 17, -np.inf)):
      x[:, start::step] = v
    return x
  if kind == "descending":
    return -np.sort(rng.rand(n, s).astype(np.float32), axis=-1)
  if kind == "ascending":                                     # the strided sample's threshold is at its worst
    return np.sort(rng.rand(n, s).astype(np.float32), axis=-1)
  if kind == "masked":                                        # SpeCache's scores: probabilities, -1 past n
    x = np.full((n, s), -1.0, np.float32)
    x[:, : s // 3] = rng.rand(n, s // 3)
    return x
  raise ValueError(kind)


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "special", "descending", "ascending", "masked"])
@pytest.mark.parametrize("s", [1, 7, 100, 1024, 1025, 8448, 20000])
def test_top_k_indices_equal_lax_top_k(kind, s):
  """Fresh random rows; k from 0 to S, incl. k = 1, 64 and S/2 (above and below the sampled threshold's range)."""
  rng = np.random.RandomState(s + len(kind))
  x = jnp.asarray(_rows(kind, rng, 3, s))
  for k in sorted({0, 1, min(s, 3), min(s, 64), s // 2, s}):
    got = jax.jit(functools.partial(select.top_k_indices, k=k))(x)
    want = select.top_k_indices_reference(x, k)
    assert got.dtype == jnp.int32 and got.shape == (3, k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{kind} S={s} k={k}")


@needs_kernel
def test_top_k_indices_leading_axes_and_many_rows():
  """[B, K, S] with B·K rows split across the work items (4 rows per item)."""
  x = jnp.asarray(np.random.RandomState(1).rand(5, 3, 700).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: select.top_k_indices(x, 33))(x)),
                                np.asarray(select.top_k_indices_reference(x, 33)))


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint8, jnp.int32])
def test_take_rows_equals_take_along_axis_clipped(dtype):
  """Any element type; indices below 0 and past S clip into range (as `attention.gather_rows` always did)."""
  rng = np.random.RandomState(2)
  buf = jnp.asarray(rng.randint(0, 100, (2, 3, 50, 12)), dtype)
  idx = jnp.asarray(rng.randint(-4, 57, (2, 3, 9)), jnp.int32)
  got = jax.jit(select.take_rows)(buf, idx)
  assert got.dtype == buf.dtype and got.shape == (2, 3, 9, 12)
  want = jnp.take_along_axis(buf, jnp.clip(idx, 0, 49)[..., None], axis=2)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(select.take_rows_reference(buf, idx)), np.asarray(want))


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "masked"])
@pytest.mark.parametrize("s", [1, 100, 1025, 8448])
def test_scatter_top_k_equals_the_dense_scores_top_k(kind, s):
  """Fresh random parts: positions in and out of [0, S) (also negative), the same position twice (added in
  order), limits below 0, inside and past S; k from 0 to S. Against the jnp composition (scatter, mask,
  lax.top_k) and against SpeCache's dense path (`Scores.dense` + `select`)."""
  rng = np.random.RandomState(s + 7 * len(kind))
  b, kv, e = 2, 3, 19
  low = _rows(kind, rng, b * kv, s).reshape(b, kv, s)
  extra = rng.rand(b, kv, e).astype(np.float32)
  pos = rng.randint(-3, s + 3, (b, kv, e)).astype(np.int32)
  pos[0, 0, :2] = min(s - 1, 5)                                 # twice the same position
  limit = np.array([[s + 4, s // 2, 0], [-1, s, 1]], np.int32)
  args = tuple(map(jnp.asarray, (low, extra, pos, limit)))
  for k in sorted({0, 1, min(s, 64), s}):
    got = jax.jit(functools.partial(select.scatter_top_k, k=k))(*args)
    want = select.scatter_top_k_reference(*args, k)
    assert got.dtype == jnp.int32 and got.shape == (b, kv, k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{kind} S={s} k={k}")
  dense = low.copy()
  for i in np.ndindex(b, kv):
    for j in range(e):
      if 0 <= pos[i][j] < s:
        dense[i][pos[i][j]] += extra[i][j]
  dense = np.where(np.arange(s) < limit[..., None], dense, -1.0).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(select.scatter_scores(*args)), dense)
  method = sc.SpeCacheConfig(topk=min(s, 64))
  n_b = jnp.asarray([s // 2, s], jnp.int32)
  pos_in = jnp.asarray(np.where((pos >= 0) & (pos < s), pos, s))
  scores = selection.Scores(jnp.asarray(low)[:, :, None], jnp.asarray(extra)[:, :, None], pos_in)
  fused = jax.jit(lambda sc_, n: selection.select_row(method, sc_, -1, n))(scores, n_b)
  np.testing.assert_array_equal(np.asarray(fused), np.asarray(selection.select(method, scores.dense()[:, :, -1], n_b)))


@needs_kernel
def test_specache_step_picks_kappa_by_the_fused_selection_on_cpu():
  """The default SpeCache step's κ_{t+1} goes through `scatter_top_k` (no separate TopK) on the CPU."""
  scores = selection.Scores(jnp.zeros((1, 2, 1, 300)), jnp.zeros((1, 2, 1, 9)), jnp.full((1, 2, 9), 300, jnp.int32))
  method = sc.SpeCacheConfig(topk=8)
  traced = jax.jit(lambda s_, n: selection.select_row(method, s_, -1, n)).trace(scores, jnp.asarray([100]))
  text = traced.lower().as_text()
  assert ck.SCATTER_TOP_K_TARGET in text and ck.TOP_K_TARGET not in text
  gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert ck.SCATTER_TOP_K_TARGET not in gpu


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "special", "descending", "ascending", "masked"])
@pytest.mark.parametrize("v", [1, 15, 16, 17, 100, 49152])
def test_argmax_equals_jnp_argmax(kind, v):
  """Fresh random rows of every kind (NaN rows: the first NaN, as jnp.argmax; ±0.0 and ±inf; ties: the first);
  plus a row of -inf only, a row whose only NaN is in the tail past the last 16 lanes, and leading axes."""
  rng = np.random.RandomState(v + 3 * len(kind))
  x = _rows(kind, rng, 5, v)
  x[1] = -np.inf
  if v > 16:
    x[2, :] = rng.randn(v)
    x[2, -1] = np.nan
  for rows in (x, x[:1], x.reshape(5, 1, v)):
    got = jax.jit(select.argmax)(jnp.asarray(rows))
    want = jnp.argmax(jnp.asarray(rows), axis=-1)
    assert got.dtype == jnp.int32 and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{kind} V={v} {rows.shape}")
    np.testing.assert_array_equal(np.asarray(select.argmax_reference(jnp.asarray(rows))), np.asarray(want))


@needs_kernel
def test_greedy_takes_the_argmax_kernel_for_float32_on_cpu_only():
  """decode's greedy token: the kernel for float32 logits on the CPU, jnp.argmax for bfloat16 and on a GPU."""
  from specache_jax import decode
  logits = jnp.asarray(np.random.RandomState(5).randn(3, 300).astype(np.float32))
  cpu = jax.jit(decode.guess).trace(logits).lower().as_text()
  assert ck.ARGMAX_TARGET in cpu
  assert ck.ARGMAX_TARGET not in jax.jit(decode.guess).trace(logits).lower(lowering_platforms=("cuda",)).as_text()
  assert ck.ARGMAX_TARGET not in jax.jit(decode.guess).trace(logits.astype(jnp.bfloat16)).lower().as_text()
  np.testing.assert_array_equal(np.asarray(jax.jit(decode.guess)(logits)), np.asarray(jnp.argmax(logits, -1)))


@needs_kernel
def test_candidate_guesses_take_the_top_k_kernel_for_float32_on_cpu_only():
  """SpeCache's speculative candidates (decode_width - 1 = 3 likeliest tokens of the vocabulary): the top-k kernel
  for float32 logits on the CPU — lax.top_k's indices, ties included —, lax.top_k for bfloat16 and on a GPU."""
  from specache_jax import decode
  method = sj.cache_config("specache", bits=1, group_size=16, residual=16, topk=8, candidates=3)
  rs = np.random.RandomState(6)
  logits = rs.randn(3, 49152).astype(np.float32)
  logits[1, [7, 900, 30000, 41]] = 9.0                          # a four-way tie at the top: the lower indices
  logits = jnp.asarray(logits)
  fn = jax.jit(lambda x: decode.guesses(method, x))
  assert ck.TOP_K_TARGET in fn.trace(logits).lower().as_text()
  assert ck.TOP_K_TARGET not in fn.trace(logits).lower(lowering_platforms=("cuda",)).as_text()
  assert ck.TOP_K_TARGET not in fn.trace(logits.astype(jnp.bfloat16)).lower().as_text()
  want = jax.lax.top_k(logits, 3)[1]
  np.testing.assert_array_equal(np.asarray(fn(logits)), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(fn(logits))[1], [7, 41, 900])


@needs_kernel
def test_kernels_name_bad_inputs():
  x = jnp.zeros((2, 10), jnp.float32)
  with pytest.raises(ValueError, match="k=11 must be in"):
    select.top_k_indices(x, 11)
  with pytest.raises(ValueError, match="float32"):
    select.top_k_indices(x.astype(jnp.bfloat16), 2)
  with pytest.raises(ValueError, match="same leading axes"):
    select.take_rows(jnp.zeros((2, 3, 10, 4)), jnp.zeros((2, 4, 5), jnp.int32))
  with pytest.raises(ValueError, match="argmax: x must be float32"):
    select.argmax(jnp.zeros((2, 0), jnp.float32))
  with pytest.raises(ValueError, match="scatter_top_k: low float32"):
    select.scatter_top_k(x, jnp.zeros((2, 3)), jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32), 2)
  with pytest.raises(ValueError, match="k=11 must be in"):
    select.scatter_top_k(x, jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32), 11)
  with pytest.raises(ValueError, match="argmax: x must be float32"):
    select.argmax(jnp.zeros((2, 5), jnp.int32))
  with pytest.raises(ValueError, match="integer idx"):
    select.take_rows(jnp.zeros((2, 10, 4)), jnp.zeros((2, 5), jnp.float32))


@needs_kernel
def test_callers_take_the_kernels_on_cpu_only():
  """SpeCache's κ choice and `gather_rows` emit the custom calls on the CPU; lowered for a GPU they do not."""
  scores = jnp.asarray(np.random.RandomState(3).rand(2, 3, 300).astype(np.float32))
  buf = jnp.zeros((2, 3, 300, 16), jnp.float32)

  def fn(scores, buf):
    idx = selection.top_k_indices(scores, 8)
    return idx, A.gather_rows(buf, idx)

  cpu = jax.jit(fn).trace(scores, buf).lower().as_text()
  assert ck.TOP_K_TARGET in cpu and ck.TAKE_ROWS_TARGET in cpu
  gpu = jax.jit(fn).trace(scores, buf).lower(lowering_platforms=("cuda",)).as_text()
  assert ck.TOP_K_TARGET not in gpu and ck.TAKE_ROWS_TARGET not in gpu
  idx, rows = jax.jit(fn)(scores, buf)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(jax.lax.top_k(scores, 8)[1]))


@needs_kernel
def test_kernels_on_a_mesh_keep_the_batch_sharded():
  from jax.sharding import NamedSharding, PartitionSpec as P
  from specache_jax import sharding
  mesh = sharding.make_mesh(2, 2)
  rng = np.random.RandomState(4)
  scores = jax.device_put(jnp.asarray(rng.rand(4, 2, 200).astype(np.float32)), NamedSharding(mesh, P("data")))
  buf = jax.device_put(jnp.asarray(rng.randn(4, 2, 200, 8).astype(np.float32)), NamedSharding(mesh, P("data")))
  fn = jax.jit(lambda s, b: (lambda i: (i, select.take_rows(b, i)))(select.top_k_indices(s, 5)))
  compiled = fn.lower(scores, buf).compile().as_text()
  assert ck.TOP_K_TARGET in compiled and ck.TAKE_ROWS_TARGET in compiled
  idx, rows = fn(scores, buf)
  assert idx.sharding.spec[0] == "data" and rows.sharding.spec[0] == "data"
  want = jax.lax.top_k(jnp.asarray(np.asarray(scores)), 5)[1]
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(rows), np.take_along_axis(np.asarray(buf), np.asarray(want)[..., None], 2))
