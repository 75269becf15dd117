"""quant_scores == quant_scores_reference: compiled on a GPU, in Pallas interpret mode on the CPU.

Inputs come from `pallas_kernels.testing`: ragged lengths (not multiples of the block or the group), S not a
multiple of block_s, and every slot past a row's length poisoned (random codes, NaN key-group scales).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.quant_scores import QuantScoresBlock
from pallas_kernels.quant_scores import quant_scores
from pallas_kernels.quant_scores import quant_scores_reference
from specache_jax import quant

SLOTS = 200                 # S: not a multiple of BLOCK.block_s (64) nor of the group sizes
LENGTHS = (200, 77, 33)     # full; mid-block and mid-group; one slot into a group
BLOCK = QuantScoresBlock(block_s=64)
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _case(bits, group_size, gqa, t, head_dim=64, dtype=jnp.float32):
  name = jnp.dtype(dtype).name
  return pytest.param(bits, group_size, gqa, t, head_dim, dtype,
                      id=f"{bits=}_{group_size=}_{gqa=}_{t=}_{head_dim=}_dtype={name}")


CASES = (
    # every (bits, group_size), GQA ratio and T rotating
    [_case(b, g, gqa, t) for (b, g), gqa, t in zip([(1, 32), (1, 64), (2, 32), (2, 64), (4, 32), (4, 64)],
                                                     [1, 3, 4, 1, 3, 4], [2, 1, 2, 1, 2, 1])]
    # every GQA ratio with both T at 2 bits
    + [_case(2, 32, gqa, t) for gqa in (1, 3, 4) for t in (1, 2) if (gqa, t) != (1, 2)]
    + [_case(1, 64, 4, 2, head_dim=128), _case(2, 32, 3, 2, head_dim=128)]
    # T = 4 (SpeCache's robust preset: the real row and 3 candidates) and T = 3 (padded to 4 for Triton)
    + [_case(1, 32, 3, 4), _case(2, 32, 4, 3)]
    + [_case(2, 32, 4, 2, dtype=jnp.bfloat16), _case(1, 64, 3, 1, dtype=jnp.bfloat16)]
)


def _inputs(bits, group_size, gqa, t, head_dim, dtype, lengths=LENGTHS, seed=0):
  return testing.quant_scores_inputs(seed, batch=len(lengths), t=t, kv_heads=2, gqa=gqa, slots=SLOTS,
                                     head_dim=head_dim, bits=bits, group_size=group_size,
                                     lengths=lengths, dtype=dtype)


def _check(got, want, dtype):
  assert got.shape == want.shape and got.dtype == jnp.float32
  got, want = np.asarray(got), np.asarray(want)
  assert not np.isnan(got).any(), "NaN in kernel output: a read past the valid length?"
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  scale = max(1.0, float(np.abs(want[finite]).max()))
  tol = TOL[dtype]
  np.testing.assert_allclose(got[finite], want[finite], rtol=tol["rtol"], atol=tol["atol"] * scale)


class TestQuantScores:
  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _needs_backend(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("compiled Pallas kernels need a GPU (the Interpret subclass runs on the CPU)")

  def _run(self, args, bits, group_size, head_dim, block=BLOCK):
    kw = dict(bits=bits, group_size=group_size, sm_scale=head_dim ** -0.5)
    return (quant_scores(*args, **kw, interpret=self.INTERPRET, block=block),
            quant_scores_reference(*args, **kw))

  @pytest.mark.parametrize("bits,group_size,gqa,t,head_dim,dtype", CASES)
  def test_matches_reference(self, bits, group_size, gqa, t, head_dim, dtype):
    args = _inputs(bits, group_size, gqa, t, head_dim, dtype)
    got, want = self._run(args, bits, group_size, head_dim)
    assert got.shape == (len(LENGTHS), 2, gqa, t, SLOTS)
    _check(got, want, dtype)

  @pytest.mark.parametrize("block_s", [32, 128])
  def test_block_sizes(self, block_s):
    args = _inputs(2, 32, 3, 2, 64, jnp.float32)
    got, want = self._run(args, 2, 32, 64, block=QuantScoresBlock(block_s=block_s))
    _check(got, want, jnp.float32)

  def test_empty_and_single_slot_rows(self):
    args = _inputs(1, 32, 4, 2, 64, jnp.float32, lengths=(0, 1, SLOTS))
    got, want = self._run(args, 1, 32, 64)
    _check(got, want, jnp.float32)
    got = np.asarray(got)
    assert np.isneginf(got[0]).all()
    assert np.isfinite(got[1, ..., 0]).all() and np.isneginf(got[1, ..., 1:]).all()


class TestQuantScoresInterpret(TestQuantScores):
  INTERPRET = True


def test_reference_agrees_with_quant_dequantize():
  """The reference's own unpacking/dequantization equals specache_jax.quant's (same layout)."""
  q, codes, scale, zero, lengths = testing.quant_scores_inputs(
      3, batch=2, t=2, kv_heads=2, gqa=3, slots=128, head_dim=64, bits=2, group_size=32,
      lengths=(128, 128), poison=False)
  want_k = quant.dequantize_keys(quant.QuantizedKeys(codes=codes, scale=scale, zero=zero), 2, 32)
  want = jnp.einsum("btkgh,bksh->bkgts", q, want_k, precision=jax.lax.Precision.HIGHEST) * 0.125
  got = quant_scores_reference(q, codes, scale, zero, lengths, bits=2, group_size=32, sm_scale=0.125)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_s=48), "block_s=48"),
    (dict(block_s=8), "block_s=8"),
    (dict(num_warps=3), "num_warps=3"),
])
def test_block_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    QuantScoresBlock(**kwargs)


@pytest.mark.parametrize("bits,group_size,head_dim,block_s,message", [
    (3, 32, 64, 64, "bits=3"),
    (2, 64, 64, 32, "group_size=64 must divide block_s=32"),
    (2, 32, 96, 64, "head_dim=96"),
    (2, 24, 64, 64, "group_size=24"),
])
def test_layout_validation(bits, group_size, head_dim, block_s, message):
  c = head_dim * bits // 8
  q = jnp.zeros((1, 1, 1, 1, head_dim))
  codes = jnp.zeros((1, 1, 64, c), jnp.uint8)
  scale = jnp.zeros((1, 1, 64 // group_size + 1, head_dim))
  with pytest.raises(ValueError, match=message):
    quant_scores(q, codes, scale, scale, jnp.zeros((1,), jnp.int32), bits=bits, group_size=group_size,
                 sm_scale=1.0, interpret=True, block=QuantScoresBlock(block_s=block_s))
