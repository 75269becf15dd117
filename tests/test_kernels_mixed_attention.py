"""mixed_decode_attention == its reference: compiled on a GPU, in Pallas interpret mode on the CPU.

Inputs come from `pallas_kernels.testing`: ragged lengths (not multiples of the block or the group), S not a
multiple of block_s, slots past a row's length poisoned (random codes, NaN scales), random exclusions with
duplicates and -1, a random extra-column mask, and NaN in extra rows that no query row reads.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.mixed_decode_attention import MixedAttentionBlock
from pallas_kernels.mixed_decode_attention import mixed_decode_attention
from pallas_kernels.mixed_decode_attention import mixed_decode_attention_reference
from specache_jax import quant

SLOTS = 200                 # S: not a multiple of block_s (32) nor of the group sizes
LENGTHS = (200, 77, 33)     # full; mid-block and mid-group; one slot into a group
NUM_SPLITS = 3             # S-blocks of 32 -> 3 splits of 3 blocks, the last one short


def _block(group_size):
  return MixedAttentionBlock(block_s=max(32, group_size), num_splits=NUM_SPLITS)
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-6), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _case(bits, group_size, gqa, t, head_dim=64, dtype=jnp.float32, n_exclude=5, n_extra=7):
  name = jnp.dtype(dtype).name
  return pytest.param(bits, group_size, gqa, t, head_dim, dtype, n_exclude, n_extra,
                      id=f"{bits=}_{group_size=}_{gqa=}_{t=}_{head_dim=}_dtype={name}_{n_exclude=}_{n_extra=}")


CASES = (
    # every (bits, group_size), GQA ratio and T rotating
    [_case(b, g, gqa, t) for (b, g), gqa, t in zip([(1, 32), (1, 64), (2, 32), (2, 64), (4, 32), (4, 64)],
                                                     [1, 3, 4, 1, 3, 4], [2, 1, 2, 1, 2, 1])]
    # the remaining GQA ratio / T pairs at 2 bits
    + [_case(2, 32, 3, 1), _case(2, 32, 4, 1), _case(2, 64, 1, 2)]
    # larger head dim, an extra block above 16 columns, no exclusions
    + [_case(1, 32, 4, 2, head_dim=128, n_extra=20), _case(2, 64, 3, 2, n_exclude=0)]
    + [_case(2, 32, 4, 2, dtype=jnp.bfloat16), _case(1, 64, 3, 1, dtype=jnp.bfloat16, n_extra=20)]
)


def _inputs(bits, group_size, gqa, t, head_dim, dtype, n_exclude, n_extra, lengths=LENGTHS, seed=0, **kw):
  return testing.mixed_inputs(seed, batch=len(lengths), t=t, kv_heads=2, gqa=gqa, slots=SLOTS,
                              head_dim=head_dim, bits=bits, group_size=group_size, lengths=lengths,
                              n_exclude=n_exclude, n_extra=n_extra, dtype=dtype, **kw)


def _check(got, want, dtype):
  names = ("out", "lowbit_probs", "extra_probs")
  for name, g, w in zip(names, got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    g = np.asarray(g, np.float32)
    w = np.asarray(w, np.float32)
    assert not np.isnan(g).any(), f"NaN in kernel {name}: a read past the valid length?"
    tol = TOL[dtype]
    scale = max(1.0, float(np.abs(w).max())) if name == "out" else 1.0
    np.testing.assert_allclose(g, w, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=name)


class TestMixedDecodeAttention:
  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _needs_backend(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("compiled Pallas kernels need a GPU (the Interpret subclass runs on the CPU)")

  def _run(self, args, bits, group_size, head_dim, block=None, **extra):
    kw = dict(bits=bits, group_size=group_size, sm_scale=head_dim ** -0.5, **extra)
    block = block or _block(group_size)
    return (mixed_decode_attention(*args, **kw, interpret=self.INTERPRET, block=block),
            mixed_decode_attention_reference(*args, **kw))

  @pytest.mark.parametrize("bits,group_size,gqa,t,head_dim,dtype,n_exclude,n_extra", CASES)
  def test_matches_reference(self, bits, group_size, gqa, t, head_dim, dtype, n_exclude, n_extra):
    args = _inputs(bits, group_size, gqa, t, head_dim, dtype, n_exclude, n_extra)
    got, want = self._run(args, bits, group_size, head_dim)
    b, k = len(LENGTHS), 2
    assert got[0].shape == (b, t, k * gqa, head_dim) and got[0].dtype == dtype
    assert got[1].shape == (b, k, SLOTS) and got[2].shape == (b, k, n_extra)
    _check(got, want, dtype)

  @pytest.mark.parametrize("block_s,num_splits", [(32, 1), (64, 2), (128, 16)])
  def test_block_sizes(self, block_s, num_splits):
    args = _inputs(2, 32, 3, 2, 64, jnp.float32, 5, 7)
    got, want = self._run(args, 2, 32, 64, block=MixedAttentionBlock(block_s=block_s,
                                                                     num_splits=num_splits))
    _check(got, want, jnp.float32)

  @pytest.mark.parametrize("bits,group_size,gqa,t,prob_rows,lowbit_values",
                           [(1, 32, 3, 4, 3, True), (2, 64, 4, 4, 4, False), (2, 32, 4, 2, 1, True),
                            (2, 32, 3, 3, 2, True)])              # T = 3: padded to 4 rows for Triton
  def test_several_rows_probabilities_match_reference(self, bits, group_size, gqa, t, prob_rows, lowbit_values):
    """prob_rows=P: the probabilities of each of the last P rows ([B, K, P, ...]; SpeCache's candidates)."""
    args = _inputs(bits, group_size, gqa, t, 64, jnp.float32, 5, 7)
    got, want = self._run(args, bits, group_size, 64, prob_rows=prob_rows, lowbit_values=lowbit_values)
    assert got[1].shape == (len(LENGTHS), 2, prob_rows, SLOTS) and got[2].shape == (len(LENGTHS), 2, prob_rows, 7)
    _check(got, want, jnp.float32)

  def test_last_row_probabilities_sum_to_one_and_respect_masks(self):
    args = _inputs(1, 32, 4, 2, 64, jnp.float32, 6, 9, mask_p=0.5)
    _, _, _, _, _, _, _, lengths, exclude, _, _, extra_mask = args
    _, p_low, p_extra = self._run(args, 1, 32, 64)[0]
    p_low, p_extra = np.asarray(p_low), np.asarray(p_extra)
    total = p_low.sum(-1) + p_extra.sum(-1)                                       # [B, K]
    has_column = (np.asarray(lengths)[:, None] > 0) | np.asarray(extra_mask)[:, :, -1].any(-1)
    np.testing.assert_allclose(total[has_column], 1.0, rtol=1e-5)
    slot = np.arange(SLOTS)
    for b in range(p_low.shape[0]):
      for k in range(p_low.shape[1]):
        dead = (slot >= int(lengths[b])) | np.isin(slot, np.asarray(exclude[b, k]))
        assert (p_low[b, k, dead] == 0).all() and (p_low[b, k, ~dead] > 0).all()
        assert (p_extra[b, k, ~np.asarray(extra_mask[b, k, -1])] == 0).all()

  @pytest.mark.parametrize("bits,group_size,gqa,t,num_splits", [(1, 32, 3, 2, 3), (2, 64, 4, 1, 1), (4, 32, 1, 3, 2)])
  def test_without_lowbit_values_outputs_the_extra_columns_softmax(self, bits, group_size, gqa, t, num_splits):
    """lowbit_values=False: probabilities as with the values, the output the reference's softmax over the extra
    columns alone (one row without any: 0), and the value codes and scales never read (NaN there changes
    nothing)."""
    args = list(_inputs(bits, group_size, gqa, t, 64, jnp.float32, 5, 9))
    args[11] = args[11].at[1, 0, t - 1].set(False)
    block = MixedAttentionBlock(block_s=max(32, group_size), num_splits=num_splits)
    got, want = self._run(tuple(args), bits, group_size, 64, block=block, lowbit_values=False)
    _check(got, want, jnp.float32)
    with_values, _ = self._run(tuple(args), bits, group_size, 64, block=block)
    for g, w in zip(got[1:], with_values[1:]):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    assert not np.asarray(got[0])[1, t - 1, :gqa].any()                      # KV head 0's query heads
    args[4], args[5], args[6] = jnp.full_like(args[4], 255), jnp.full_like(args[5], jnp.nan), jnp.full_like(
        args[6], jnp.nan)
    poisoned, _ = self._run(tuple(args), bits, group_size, 64, block=block, lowbit_values=False)
    for g, w in zip(poisoned, got):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

  def test_fully_masked_rows_give_zero(self):
    # Row b=0 has no low-bit slot; with an all-False extra mask it has no column at all.
    args = list(_inputs(2, 32, 3, 2, 64, jnp.float32, 3, 7, lengths=(0, 77, 33)))
    args[11] = args[11].at[0].set(False)
    got, want = self._run(tuple(args), 2, 32, 64)
    _check(got, want, jnp.float32)
    out, p_low, p_extra = (np.asarray(x) for x in got)
    assert (out[0] == 0).all() and (p_low[0] == 0).all() and (p_extra[0] == 0).all()
    assert np.abs(out[1]).max() > 0


class TestMixedDecodeAttentionInterpret(TestMixedDecodeAttention):
  INTERPRET = True


def test_reference_agrees_with_dense_softmax_over_quant_dequantize():
  """Without exclusions and extra columns the reference is softmax(q·k̂ᵀ)·v̂ with quant's dequantizers."""
  b, t, kh, g, h, s, bits, gs = 2, 2, 2, 3, 64, 128, 2, 32
  args = testing.mixed_inputs(5, batch=b, t=t, kv_heads=kh, gqa=g, slots=s, head_dim=h, bits=bits,
                              group_size=gs, lengths=(s, s), n_exclude=2, n_extra=3, poison=False)
  q, kc, ks, kz, vc, vs, vz, lengths, _, ek, ev, _ = args
  none = jnp.full((b, kh, 2), -1, jnp.int32)
  no_extra = jnp.zeros((b, kh, t, 3), bool)
  out, p_low, p_extra = mixed_decode_attention_reference(
      q, kc, ks, kz, vc, vs, vz, lengths, none, ek, ev, no_extra, bits=bits, group_size=gs, sm_scale=0.125)
  k_hat = quant.dequantize_keys(quant.QuantizedKeys(codes=kc, scale=ks, zero=kz), bits, gs)
  v_hat = quant.dequantize_values(quant.QuantizedValues(codes=vc, scale=vs, zero=vz), bits, gs)
  hi = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("btkgh,bksh->bkgts", q.reshape(b, t, kh, g, h), k_hat, precision=hi) * 0.125
  probs = jax.nn.softmax(logits, axis=-1)
  want = jnp.einsum("bkgts,bksh->btkgh", probs, v_hat, precision=hi).reshape(b, t, kh * g, h)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(p_low, probs[:, :, :, -1].mean(axis=2), rtol=1e-5, atol=1e-8)
  assert (np.asarray(p_extra) == 0).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_s=48), "block_s=48"),
    (dict(num_splits=0), "num_splits=0"),
    (dict(num_stages=0), "num_stages=0"),
])
def test_block_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    MixedAttentionBlock(**kwargs)


@pytest.mark.parametrize("change,message", [
    ("extra_mask_dtype", "extra_mask"),
    ("no_extra", "extra_k.shape"),
    ("v_scale_shape", "v_scale.shape"),
    ("group_larger_than_block", "group_size=64 must divide block_s=32"),
])
def test_input_validation(change, message):
  args = list(_inputs(2, 32, 1, 1, 64, jnp.float32, 2, 3, lengths=(10,)))
  group_size = 32
  if change == "extra_mask_dtype":
    args[11] = args[11].astype(jnp.int32)
  elif change == "no_extra":
    args[9], args[10], args[11] = args[9][:, :, :0], args[10][:, :, :0], args[11][..., :0]
  elif change == "v_scale_shape":
    args[5] = args[5][:, :, :-1]
  else:
    group_size = 64
  with pytest.raises(ValueError, match=message):
    mixed_decode_attention(*args, bits=2, group_size=group_size, sm_scale=1.0, interpret=True,
                           block=MixedAttentionBlock(block_s=32))
