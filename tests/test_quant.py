"""specache_jax.quant: bit packing layout, KIVI / SpeCache min-max quantizers, numerics at the edges."""
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specache_jax import quant

F32_EPS = float(np.finfo(np.float32).eps)
TINY = 4 * float(np.finfo(np.float32).tiny)   # absolute slack: XLA flushes float32 subnormals to zero


def _np_pack(codes, bits):
  """Reference packing with explicit loops: code j -> byte j // (8/b), bit offset (j % (8/b)) * b."""
  per = 8 // bits
  flat = codes.reshape(-1, codes.shape[-1])
  out = np.zeros((flat.shape[0], codes.shape[-1] * bits // 8), np.uint8)
  for r in range(flat.shape[0]):
    for j in range(flat.shape[1]):
      out[r, j // per] |= np.uint8(int(flat[r, j]) << ((j % per) * bits))
  return out.reshape(codes.shape[:-1] + (out.shape[-1],))


def _assert_below(err, bound):
  """err < bound elementwise (bound broadcast to err's shape), reporting the worst element."""
  bound = np.broadcast_to(bound, err.shape)
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert np.all(err < bound), f"error {err[worst]} >= bound {bound[worst]} at {worst}"


def _slack(x_f64, axis):
  """Float32 rounding slack per group: a few ulps of the group's largest magnitude."""
  return 16 * F32_EPS * np.max(np.abs(x_f64), axis=axis, keepdims=True) + TINY


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _round_trip(x, bits, axis, one_bit):
  """One compiled quantize_minmax -> (codes, scale, zero, dequantized, unpack(pack(codes)))."""
  codes, scale, zero = quant.quantize_minmax(x, bits, axis, one_bit=one_bit)
  repacked = quant.unpack_bits(quant.pack_bits(codes, bits), bits, x.shape[-1])
  return codes, scale, zero, quant.dequantize_minmax(codes, scale, zero), repacked


def _rule_bound(lo, hi, bits, one_bit):
  """The largest error a rule allows on a group with min lo and max hi (before rounding slack): half a step for
  the range rules."""
  if bits == 1 and one_bit == "specache":
    return (hi - lo) / 4
  return (hi - lo) / (2**bits - 1) / 2


def _check_minmax_error(x, bits, one_bit, axis):
  """quantize_minmax -> dequantize_minmax; asserts the per-element error bound of the rule in force."""
  codes, scale, _, x_hat, _ = _round_trip(jnp.asarray(x), bits, axis, one_bit)
  x_hat = np.asarray(x_hat, np.float64)
  xf = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  lo, hi = xf.min(axis=axis, keepdims=True), xf.max(axis=axis, keepdims=True)
  err = np.abs(x_hat - xf)
  assert np.all(np.isfinite(x_hat)) and np.all(np.isfinite(np.asarray(scale, np.float64)))
  assert int(np.asarray(codes).max()) <= (1 if bits == 1 and one_bit == "specache" else 2**bits - 1)
  bound = _rule_bound(lo, hi, bits, one_bit)
  # A scale below float32's smallest normal is flushed to zero by XLA: such groups collapse to the zero
  # point, an error of at most 2^b * tiny (documented limit).
  _assert_below(err, bound + _slack(xf, axis) + 2**bits * TINY)
  return np.asarray(codes), x_hat


# ----------------------------------------------------------------------------------------------- packing

@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("shape", [(16,), (3, 5, 16), (2, 1, 3, 64), (7, 8)])
def test_pack_unpack_round_trip_and_layout(bits, shape):
  rng = np.random.default_rng(bits * 100 + len(shape))
  codes = rng.integers(0, 2**bits, size=shape, dtype=np.uint8)
  packed = quant.pack_bits(jnp.asarray(codes), bits)
  assert packed.dtype == jnp.uint8 and packed.shape == shape[:-1] + (shape[-1] * bits // 8,)
  np.testing.assert_array_equal(np.asarray(packed), _np_pack(codes, bits))
  np.testing.assert_array_equal(np.asarray(quant.unpack_bits(packed, bits, shape[-1])), codes)
  jitted = jax.jit(quant.unpack_bits, static_argnums=(1, 2))(packed, bits, shape[-1])
  np.testing.assert_array_equal(np.asarray(jitted), codes)


def test_pack_layout_by_hand():
  # 2-bit codes [1, 2, 3, 0] -> 1 | 2 << 2 | 3 << 4 | 0 << 6 = 57; 1-bit [1,0,0,0,0,0,0,1] -> 129.
  assert int(quant.pack_bits(jnp.array([1, 2, 3, 0], jnp.uint8), 2)[0]) == 57
  assert int(quant.pack_bits(jnp.array([1, 0, 0, 0, 0, 0, 0, 1], jnp.uint8), 1)[0]) == 129
  assert int(quant.pack_bits(jnp.array([0xA, 0x3], jnp.uint8), 4)[0]) == 0x3A


@pytest.mark.parametrize("bits", quant.BITS)
def test_packed_sizes_really_shrink(bits):
  x = jax.random.normal(jax.random.key(0), (2, 3, 32, 16), jnp.bfloat16)
  qk = quant.quantize_keys(x, bits, 8)
  qv = quant.quantize_values(x, bits, 8)
  assert qk.codes.nbytes == x.size * bits // 8 and qv.codes.nbytes == x.size * bits // 8
  assert qk.codes.shape == (2, 3, 32, 16 * bits // 8) and qk.scale.shape == (2, 3, 4, 16)
  assert qv.codes.shape == (2, 3, 32, 16 * bits // 8) and qv.scale.shape == (2, 3, 32, 2)
  assert qk.scale.dtype == jnp.bfloat16 and qv.zero.dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------- error bounds

@pytest.mark.parametrize("bits,one_bit", [(2, "specache"), (4, "specache"), (8, "specache"), (1, "kivi"),
                                          (1, "specache")])
def test_keys_and_values_error_bound(bits, one_bit):
  g = 8
  x = np.asarray(jax.random.normal(jax.random.key(bits), (2, 3, 32, 16), jnp.float32)) * 3 + 1
  b, k, s, h = x.shape
  xk = x.reshape(b, k, s // g, g, h)
  xv = x.reshape(b, k, s, h // g, g)
  if bits == 1 and one_bit == "specache":
    bk = (xk.max(3, keepdims=True) - xk.min(3, keepdims=True)) / 4
    bv = (xv.max(4, keepdims=True) - xv.min(4, keepdims=True)) / 4
  else:
    bk = (xk.max(3, keepdims=True) - xk.min(3, keepdims=True)) / (2**bits - 1) / 2
    bv = (xv.max(4, keepdims=True) - xv.min(4, keepdims=True)) / (2**bits - 1) / 2
  qk = quant.quantize_keys(jnp.asarray(x), bits, g, one_bit=one_bit)
  k_hat = np.asarray(quant.dequantize_keys(qk, bits, g)).reshape(xk.shape)
  _assert_below(np.abs(k_hat - xk), bk + _slack(xk, 3))
  qv = quant.quantize_values(jnp.asarray(x), bits, g, one_bit=one_bit)
  v_hat = np.asarray(quant.dequantize_values(qv, bits, g)).reshape(xv.shape)
  _assert_below(np.abs(v_hat - xv), bv + _slack(xv, 4))
  # Jitted with static arguments gives the same result.
  qk_jit = jax.jit(quant.quantize_keys, static_argnums=(1, 2, 3))(jnp.asarray(x), bits, g, one_bit)
  np.testing.assert_array_equal(np.asarray(qk_jit.codes), np.asarray(qk.codes))


def test_more_bits_less_error():
  x = jax.random.normal(jax.random.key(7), (1, 2, 64, 16), jnp.float32)
  errs = [float(jnp.abs(quant.dequantize_keys(quant.quantize_keys(x, b, 16), b, 16) - x).mean())
          for b in (2, 4, 8)]
  assert errs[0] > errs[1] > errs[2]


# ----------------------------------------------------------------------------------------- 1-bit rules

def test_specache_one_bit_levels_and_clip():
  x = np.asarray(jax.random.uniform(jax.random.key(3), (4, 6, 32), jnp.float32, -5, 9))
  codes, x_hat = _check_minmax_error(x, 1, "specache", axis=-1)
  assert set(np.unique(codes).tolist()) == {0, 1}
  lo, hi = x.astype(np.float64).min(-1, keepdims=True), x.astype(np.float64).max(-1, keepdims=True)
  level = np.where(codes == 1, lo + 3 * (hi - lo) / 4, lo + (hi - lo) / 4)
  np.testing.assert_allclose(x_hat, level, rtol=0, atol=4 * F32_EPS * np.abs(x).max())
  # The group max sits at ratio 1.5 (rounds to 2 without the clip): it must be code 1; the min code 0.
  np.testing.assert_array_equal(np.take_along_axis(codes, x.argmax(-1)[..., None], -1), 1)
  np.testing.assert_array_equal(np.take_along_axis(codes, x.argmin(-1)[..., None], -1), 0)


def test_specache_one_bit_through_keys_and_values():
  x2 = jnp.asarray([[0.0, 5.0], [1.0, 0.0], [3.0, 8.0], [4.0, 2.0]])      # [S=4, 2 channels]
  x = jnp.tile(x2, (1, 4)).reshape(1, 1, 4, 8)                           # [1, 1, 4, 8]
  qk = quant.quantize_keys(x, 1, 4, one_bit="specache")
  # Channel 0: m=0, M=4 -> levels 1, 3; channel 1: m=0, M=8 -> levels 2, 6.
  expected = np.tile([[1.0, 6.0], [1.0, 2.0], [3.0, 6.0], [3.0, 2.0]], (1, 4))
  np.testing.assert_array_equal(np.asarray(quant.dequantize_keys(qk, 1, 4))[0, 0], expected)
  kivi = quant.quantize_keys(x, 1, 4, one_bit="kivi")
  np.testing.assert_array_equal(np.asarray(quant.dequantize_keys(kivi, 1, 4))[0, 0],
                                np.tile([[0.0, 8.0], [0.0, 0.0], [4.0, 8.0], [4.0, 0.0]], (1, 4)))
  xv = jnp.asarray([[[[0.0, 2.0, 4.0, 8.0, 1.0, 1.5, 1.5, 2.0]]]])       # [1, 1, 1, 8], g = 8
  qv = quant.quantize_values(xv, 1, 8)
  np.testing.assert_array_equal(np.asarray(quant.dequantize_values(qv, 1, 8))[0, 0, 0],
                                [2.0, 2.0, 2.0, 6.0, 2.0, 2.0, 2.0, 2.0])


@pytest.mark.parametrize("bits,one_bit", [(1, "specache"), (1, "kivi"), (2, "specache"), (8, "kivi")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_constant_groups_are_exact(bits, one_bit, dtype):
  consts = jnp.asarray([0.0, -3.75, 1e30, -2e-38, 65504.0], dtype)
  x = jnp.broadcast_to(consts.reshape(1, 5, 1, 1), (1, 5, 16, 8)).astype(dtype)   # [B, K, S, H]
  k_hat = quant.dequantize_keys(quant.quantize_keys(x, bits, 8, one_bit), bits, 8, dtype)
  v_hat = quant.dequantize_values(quant.quantize_values(x, bits, 8, one_bit), bits, 8, dtype)
  np.testing.assert_array_equal(np.asarray(k_hat, np.float32), np.asarray(x, np.float32))
  np.testing.assert_array_equal(np.asarray(v_hat, np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("bits,one_bit", [(1, "specache"), (1, "kivi"), (2, "specache"), (4, "kivi"), (8, "kivi")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_extreme_magnitudes_stay_finite_and_bounded(bits, one_bit, dtype):
  big = float(jnp.finfo(dtype).max)
  rows = np.array([[-big, big, 0.0, 1.0, -1.0, 0.5 * big, -0.25 * big, 3e37],
                   [1e4, -1e4, 3.0, 2e4, 7.0, -5e3, 1.0, 0.0],
                   [1e38, 1e38, 1e38, 1e38, -1e38, 1e-30, 5e37, 1e38],
                   [-big, -big, -big, -big, -big, -big, -big, -big]], np.float32)
  x = jnp.asarray(rows).astype(dtype)
  codes, _ = _check_minmax_error(x, bits, one_bit, axis=-1)   # jitted (XLA may fuse q * s + z)
  eager = quant.dequantize_minmax(*quant.quantize_minmax(x, bits, -1, one_bit=one_bit))   # op by op
  np.testing.assert_array_equal(np.asarray(quant.quantize_minmax(x, bits, -1, one_bit=one_bit)[0]), codes)
  assert bool(jnp.all(jnp.isfinite(eager)))


def test_kivi_one_bit_range_overflow_is_finite():
  # M - m exceeds float32 max: the scale saturates (documented limit) but nothing becomes inf/NaN.
  big = float(np.finfo(np.float32).max)
  x = jnp.asarray([[-big, big, 0.0, 1.0]], jnp.float32)
  codes, scale, zero = quant.quantize_minmax(x, 1, -1, one_bit="kivi")
  x_hat = quant.dequantize_minmax(codes, scale, zero)
  assert bool(jnp.all(jnp.isfinite(x_hat))) and bool(jnp.all(jnp.isfinite(scale)))


def test_bfloat16_scale_storage():
  x = jax.random.normal(jax.random.key(11), (2, 2, 16, 16), jnp.float32) * 4 + 2
  for bits in (1, 2, 4):
    qk = quant.quantize_keys(x, bits, 8, dtype=jnp.bfloat16)
    qv = quant.quantize_values(x, bits, 8, dtype=jnp.bfloat16)
    assert qk.scale.dtype == qk.zero.dtype == qv.scale.dtype == qv.zero.dtype == jnp.bfloat16
    for x_hat, codes, scale, zero, axis in (
        (quant.dequantize_keys(qk, bits, 8), quant.unpack_bits(qk.codes, bits, 16).reshape(2, 2, 2, 8, 16),
         qk.scale[:, :, :, None, :], qk.zero[:, :, :, None, :], 3),
        (quant.dequantize_values(qv, bits, 8), quant.unpack_bits(qv.codes, bits, 16).reshape(2, 2, 16, 2, 8),
         qv.scale[..., None], qv.zero[..., None], 4)):
      # The stored (bf16) parameters define the levels; each element lands on its nearest level.
      xs = np.asarray(x).reshape(codes.shape).astype(np.float64)
      s, z = np.asarray(scale, np.float64), np.asarray(zero, np.float64)
      levels = z[..., None] + s[..., None] * np.arange(2**bits)
      nearest = np.abs(xs[..., None] - levels).min(-1)
      err = np.abs(np.asarray(x_hat).reshape(xs.shape) - xs)
      _assert_below(err, nearest + _slack(xs, axis))
      assert float(err.max()) < 16.0   # sanity: well below the data range (~40)
      assert int(codes.max()) <= (1 if bits == 1 else 2**bits - 1)


# ----------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs,needle", [
    (dict(bits=3, group_size=4, head_dim=16), "bits=3"),
    (dict(bits=2, group_size=0, head_dim=16), "group_size=0"),
    (dict(bits=2, group_size=-4, head_dim=16), "group_size=-4"),
    (dict(bits=2, group_size=5, head_dim=16), "head_dim=16"),
    (dict(bits=2, group_size=4, head_dim=16, residual=6), "residual=6"),
    (dict(bits=1, group_size=2, head_dim=6), "head_dim=6"),
])
def test_validate_names_the_value(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    quant.validate(**kwargs)


def test_validate_accepts_good_layouts():
  quant.validate(1, 32, 64, residual=64)
  quant.validate(2, 16, 128)
  quant.validate(8, 1, 1)


def test_other_errors_name_the_value():
  x = jnp.zeros((1, 1, 12, 8), jnp.float32)
  with pytest.raises(ValueError, match="one_bit='sign'"):
    quant.quantize_minmax(x, 1, -1, one_bit="sign")
  with pytest.raises(ValueError, match="group_size=8"):
    quant.quantize_keys(x, 2, 8)                   # S = 12 not a multiple of 8
  with pytest.raises(ValueError, match="bits=3"):
    quant.pack_bits(jnp.zeros((8,), jnp.uint8), 3)
  with pytest.raises(ValueError, match="n=3"):
    quant.pack_bits(jnp.zeros((3,), jnp.uint8), 2)
  with pytest.raises(ValueError, match="group_size=3"):
    quant.quantize_values(x, 2, 3)


def test_bits_per_element():
  assert quant.bits_per_element(2, 32) == 3.0
  assert quant.bits_per_element(1, 64, scale_bytes=4) == 2.0
  assert quant.bits_per_element(8, 128) == 8.25


# ------------------------------------------------------------------------------------- property test

@st.composite
def _groups(draw):
  bits = draw(st.sampled_from(quant.BITS))
  one_bit = draw(st.sampled_from(quant.ONE_BIT_RULES))
  lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
  n = 8 * draw(st.integers(1, 3))                 # last axis, packable for every b
  shape = lead + (n,)
  axis = draw(st.integers(-len(shape), len(shape) - 1))
  seed = draw(st.integers(0, 2**31 - 1))
  exponent = draw(st.sampled_from([-38, -20, -3, 0, 4, 20, 37, 38]))
  kind = draw(st.sampled_from(["random", "constant", "extreme", "mixed"]))
  dtype = draw(st.sampled_from([np.float32, jnp.bfloat16]))
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 10.0**exponent
  if kind == "constant":
    x = np.full(shape, x.flat[0])
  elif kind == "extreme":
    x = rng.choice([-3.3e38, 3.3e38, 1e38, -1e4, 0.0], size=shape)
  elif kind == "mixed":
    x.flat[0] = 3.3e38
  x = np.clip(x, -3.3e38, 3.3e38).astype(np.float32)
  x[np.abs(x) < np.finfo(np.float32).tiny] = 0.0   # XLA flushes subnormals (documented in quant.py)
  return bits, one_bit, axis, x.astype(dtype)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(_groups())
def test_property_minmax_and_pack(case):
  bits, one_bit, axis, x = case
  codes, scale, zero, x_hat, repacked = _round_trip(jnp.asarray(x), bits, axis, one_bit)
  assert codes.shape == x.shape and codes.dtype == jnp.uint8
  assert scale.dtype == zero.dtype == x.dtype
  assert scale.shape[axis % x.ndim] == 1 and scale.ndim == x.ndim
  np.testing.assert_array_equal(np.asarray(repacked), np.asarray(codes))
  xf = np.asarray(x, np.float64)
  lo, hi = xf.min(axis, keepdims=True), xf.max(axis, keepdims=True)
  x_hat = np.asarray(x_hat, np.float64)
  assert np.all(np.isfinite(x_hat))
  constant = np.broadcast_to(lo == hi, x.shape)
  np.testing.assert_array_equal(x_hat[constant], xf[constant])
  kivi_overflow = bits == 1 and one_bit == "kivi" and np.any(hi - lo > float(np.finfo(x.dtype).max))
  if x.dtype == np.float32 and not kivi_overflow:
    _check_minmax_error(x, bits, one_bit, axis)
  elif not kivi_overflow:
    # bf16 storage: error bounded by the rule's bound plus bf16 rounding of scale and zero.
    rule = _rule_bound(lo, hi, bits, one_bit)
    slack = 2**bits * (2**-8 * np.maximum(np.abs(lo), np.abs(hi)) + TINY)
    _assert_below(np.abs(x_hat - xf), rule + slack)
