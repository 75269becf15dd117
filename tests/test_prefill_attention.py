"""Blockwise prefill attention equals the dense float32 reference; rows of a ragged batch equal the rows alone;
the compiled program never holds a [T, T] float32 matrix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specache_jax.caches import attention as A


def _inputs(seed, batch, t, n_kv, group, head_dim, dtype=jnp.float32):
  rs = np.random.RandomState(seed)
  q = rs.randn(batch, t, n_kv * group, head_dim)
  k = rs.randn(batch, t, n_kv, head_dim)
  v = rs.randn(batch, t, n_kv, head_dim)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _blockwise(blocks, want_colsum):
  return jax.jit(lambda q, k, v, lengths: A.prefill_attention(q, k, v, lengths, q.shape[-1] ** -0.5,
                                                              want_colsum, blocks))


CASES = [  # batch, t, n_kv, group, head_dim, lengths, block_q, block_k
    (3, 100, 2, 3, 16, [100, 1, 57], 16, 32),     # T not a multiple of either block, a length-1 row
    (2, 19, 1, 1, 8, [19, 5], 512, 512),          # T below one block: a single block
    (2, 300, 3, 1, 8, [300, 129], 64, 24),        # G = 1, block_q not a multiple of block_k
    (1, 256, 2, 4, 8, [256], 32, 32),             # T a multiple of the block
    (4, 77, 2, 2, 8, [1, 77, 40, 8], 8, 16),      # many small blocks, every row ragged
]


@pytest.mark.parametrize("want_colsum", [False, True], ids=lambda w: f"{w=}")
@pytest.mark.parametrize("batch, t, n_kv, group, head_dim, lengths, block_q, block_k", CASES,
                         ids=lambda x: str(x).replace(" ", ""))
def test_blockwise_equals_dense_reference(batch, t, n_kv, group, head_dim, lengths, block_q, block_k,
                                          want_colsum):
  q, k, v = _inputs(t + block_q, batch, t, n_kv, group, head_dim)
  lengths = jnp.asarray(lengths, jnp.int32)
  out, colsum = _blockwise(A.PrefillBlocks(block_q, block_k), want_colsum)(q, k, v, lengths)
  ref_out, ref_colsum = A.prefill_attention_reference(q, k, v, lengths, head_dim ** -0.5, want_colsum)
  assert out.shape == (batch, t, n_kv * group, head_dim) and out.dtype == q.dtype
  # every row, padding included: a padding row attends to its whole prompt in both
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-4, rtol=0)
  if not want_colsum:
    assert colsum is None and ref_colsum is None
    return
  assert colsum.shape == (batch, n_kv, t) and colsum.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(colsum), np.asarray(ref_colsum), atol=1e-4, rtol=0)
  # each valid query row hands out one unit of attention per head: the column sums add up to the length
  np.testing.assert_allclose(np.asarray(colsum).sum(-1), np.broadcast_to(np.asarray(lengths)[:, None],
                                                                         (batch, n_kv)), rtol=1e-5)


def test_ragged_rows_equal_each_row_alone_whatever_the_padding_holds():
  lengths = [45, 1, 64, 30]
  q, k, v = _inputs(7, 4, 64, 2, 3, 8)
  garbage = _inputs(8, 4, 64, 2, 3, 8)
  valid = (np.arange(64)[None, :] < np.asarray(lengths)[:, None])[:, :, None, None]
  q, k, v = (jnp.where(valid, x, 1e3 * g) for x, g in zip((q, k, v), garbage))
  blocks = A.PrefillBlocks(16, 8)
  out, colsum = _blockwise(blocks, True)(q, k, v, jnp.asarray(lengths))
  for b, n in enumerate(lengths):
    alone_out, alone_colsum = _blockwise(blocks, True)(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n],
                                                       jnp.asarray([n]))
    np.testing.assert_allclose(np.asarray(out[b, :n]), np.asarray(alone_out[0]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(colsum[b, :, :n]), np.asarray(alone_colsum[0]), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(colsum[b, :, n:]), 0.0)


def test_bfloat16_inputs_run_close_to_the_float32_reference():
  q, k, v = _inputs(3, 2, 90, 2, 2, 16, jnp.bfloat16)
  lengths = jnp.asarray([90, 33])
  out, colsum = _blockwise(A.PrefillBlocks(32, 16), True)(q, k, v, lengths)
  ref_out, ref_colsum = A.prefill_attention_reference(q, k, v, lengths, 0.25, True)
  assert out.dtype == jnp.bfloat16 and colsum.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=2e-2, rtol=0)
  np.testing.assert_allclose(np.asarray(colsum), np.asarray(ref_colsum), atol=1e-4, rtol=0)


@pytest.mark.parametrize("want_colsum", [False, True], ids=lambda w: f"{w=}")
def test_compiled_program_holds_no_t_by_t_matrix(want_colsum):
  t, blocks = 4096, A.PrefillBlocks(128, 128)
  q = jax.ShapeDtypeStruct((1, t, 9, 64), jnp.float32)
  k = v = jax.ShapeDtypeStruct((1, t, 3, 64), jnp.float32)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  compiled = _blockwise(blocks, want_colsum).lower(q, k, v, lengths).compile()
  temp_bytes = compiled.memory_analysis().temp_size_in_bytes
  assert temp_bytes < t * t * 4, f"{temp_bytes=} holds a [T, T] float32 matrix ({t * t * 4} bytes)"


@pytest.mark.parametrize("bad, match", [(dict(block_q=0), "block_q=0"), (dict(block_k=100), "block_k=100"),
                                        (dict(block_q=64.0), "block_q=64.0")], ids=str)
def test_bad_block_sizes_fail_clearly(bad, match):
  with pytest.raises(ValueError, match=match):
    A.PrefillBlocks(**bad).validate()
