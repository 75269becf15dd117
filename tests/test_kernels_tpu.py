"""The Mosaic TPU kernels (`pallas_kernels/tpu/`) == the GPU kernels' float32 references, in TPU interpret mode on
the CPU; and both lower for the `tpu` platform here (a Mosaic `tpu_custom_call` in the StableHLO).

TPU interpret mode (`pltpu.InterpretParams`) simulates the TPU's memories: uninitialised buffers are NaN and a
block index outside an array raises. Inputs come from `pallas_kernels.testing`: ragged lengths (a full row, one
slot into a key group, one inside the first block), S not a multiple of block_s, slots past a row's length poisoned
(random codes, NaN scales; NaN in extra columns no row reads), random exclusions with duplicates and -1. Lowering
runs the Pallas→Mosaic translation (block shapes, dtypes, op support); Mosaic's own compilation to TPU code happens
on a TPU and is not covered here.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import testing
from pallas_kernels.mixed_decode_attention import mixed_decode_attention_reference
from pallas_kernels.quant_scores import quant_scores_reference
from pallas_kernels.tpu.mixed_decode_attention import MixedAttentionTPUBlock
from pallas_kernels.tpu.mixed_decode_attention import mixed_decode_attention
from pallas_kernels.tpu.quant_scores import QuantScoresTPUBlock
from pallas_kernels.tpu.quant_scores import quant_scores

SLOTS = 600                 # S: 3 blocks of 256 (g=32) or 2 of 512 (g=64), the last one short
LENGTHS = (600, 289, 37)    # full; one slot into a group (and into block 1 at g=32); inside the first block
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-6), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SDS = jax.ShapeDtypeStruct
MOSAIC_CALL = "tpu_custom_call"


def _block_s(group_size):
  return 8 * max(32, group_size)      # the smallest block holding 8 key groups: 256 or 512


def _id(**kw):
  return "_".join(f"{k}={jnp.dtype(v).name if k == 'dtype' else v}" for k, v in kw.items())


def _check(name, got, want, dtype):
  assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert not np.isnan(got).any(), f"NaN in kernel {name}: a read past the valid length?"
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)
  finite = np.isfinite(want)
  scale = max(1.0, float(np.abs(want[finite]).max())) if finite.any() else 1.0
  tol = TOL[dtype]
  np.testing.assert_allclose(got[finite], want[finite], rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=name)


# ------------------------------------------------------------------------------------------------------------
# quant_scores

QS_CASES = [pytest.param(*c, id=_id(bits=c[0], group_size=c[1], gqa=c[2], t=c[3], head_dim=c[4], dtype=c[5]))
            for c in [(1, 32, 3, 1, 64, jnp.float32), (2, 64, 4, 4, 128, jnp.float32),
                      (2, 32, 4, 2, 64, jnp.float32), (1, 64, 3, 4, 128, jnp.bfloat16)]]


@pytest.mark.parametrize("bits,group_size,gqa,t,head_dim,dtype", QS_CASES)
def test_quant_scores_matches_reference(bits, group_size, gqa, t, head_dim, dtype):
  args = testing.quant_scores_inputs(0, batch=len(LENGTHS), t=t, kv_heads=2, gqa=gqa, slots=SLOTS,
                                     head_dim=head_dim, bits=bits, group_size=group_size, lengths=LENGTHS,
                                     dtype=dtype)
  kw = dict(bits=bits, group_size=group_size, sm_scale=head_dim ** -0.5)
  got = quant_scores(*args, **kw, interpret=True, block=QuantScoresTPUBlock(_block_s(group_size)))
  assert got.shape == (len(LENGTHS), 2, gqa, t, SLOTS)
  _check("scores", got, quant_scores_reference(*args, **kw), dtype)


def test_quant_scores_row_without_slots_is_all_neg_inf():
  args = testing.quant_scores_inputs(1, batch=2, t=2, kv_heads=2, gqa=3, slots=SLOTS, head_dim=64, bits=2,
                                     group_size=32, lengths=(0, 300))
  kw = dict(bits=2, group_size=32, sm_scale=0.125)
  got = quant_scores(*args, **kw, interpret=True, block=QuantScoresTPUBlock(256))
  assert np.isneginf(np.asarray(got[0])).all()
  _check("scores", got, quant_scores_reference(*args, **kw), jnp.float32)


# ------------------------------------------------------------------------------------------------------------
# mixed_decode_attention

def _mixed_inputs(bits, group_size, gqa, t, head_dim, dtype, lengths=LENGTHS, seed=0, n_extra=9):
  return testing.mixed_inputs(seed, batch=len(lengths), t=t, kv_heads=2, gqa=gqa, slots=SLOTS, head_dim=head_dim,
                              bits=bits, group_size=group_size, lengths=lengths, n_exclude=5, n_extra=n_extra,
                              dtype=dtype)


def _run_mixed(args, bits, group_size, head_dim, interpret=True, **kw):
  kw = dict(bits=bits, group_size=group_size, sm_scale=head_dim ** -0.5, **kw)
  got = mixed_decode_attention(*args, **kw, interpret=interpret, block=MixedAttentionTPUBlock(_block_s(group_size)))
  return got, mixed_decode_attention_reference(*args, **kw)


MIXED_CASES = [
    pytest.param(*c, id=_id(bits=c[0], group_size=c[1], gqa=c[2], t=c[3], head_dim=c[4], dtype=c[5],
                            prob_rows=c[6], lowbit_values=c[7]))
    for c in [
        (2, 32, 3, 1, 64, jnp.float32, None, True),         # plain decode: the last (only) row
        (1, 64, 4, 2, 128, jnp.float32, None, True),        # one speculative row
        (1, 32, 3, 4, 128, jnp.float32, 3, True),           # the robust preset: rows 1..3 of T=4
        (2, 64, 4, 4, 64, jnp.float32, 4, False),           # hedged candidates, scores only
        (2, 32, 4, 2, 64, jnp.float32, None, False),
        (1, 32, 3, 3, 64, jnp.bfloat16, 2, True),          # two candidates
    ]]


@pytest.mark.parametrize("bits,group_size,gqa,t,head_dim,dtype,prob_rows,lowbit_values", MIXED_CASES)
def test_mixed_attention_matches_reference(bits, group_size, gqa, t, head_dim, dtype, prob_rows, lowbit_values):
  args = _mixed_inputs(bits, group_size, gqa, t, head_dim, dtype)
  got, want = _run_mixed(args, bits, group_size, head_dim, prob_rows=prob_rows, lowbit_values=lowbit_values)
  b, k = len(LENGTHS), 2
  rows = () if prob_rows is None else (prob_rows,)
  assert got[0].shape == (b, t, k * gqa, head_dim) and got[0].dtype == dtype
  assert got[1].shape == (b, k) + rows + (SLOTS,) and got[2].shape == (b, k) + rows + (9,)
  for name, g, w in zip(("out", "lowbit_probs", "extra_probs"), got, want):
    _check(name, g, w, dtype)


def test_mixed_attention_several_rows_probabilities_are_each_rows():
  """prob_rows=P gives each of the last P rows what prob_rows=None gives the last: row T-1 is the last slice,
  and each row's probabilities sum to 1 over the columns it sees (here with the parallel grid axes visited in a
  random order and DMAs executed eagerly)."""
  args = _mixed_inputs(2, 32, 3, 4, 64, jnp.float32, seed=3)
  shuffled = pltpu.InterpretParams(random_seed=7, dma_execution_mode="eager")
  (_, p_low, p_extra), _ = _run_mixed(args, 2, 32, 64, interpret=shuffled, prob_rows=4)
  (_, last_low, last_extra), _ = _run_mixed(args, 2, 32, 64)
  np.testing.assert_allclose(np.asarray(p_low[:, :, -1]), np.asarray(last_low), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(np.asarray(p_extra[:, :, -1]), np.asarray(last_extra), rtol=1e-6, atol=1e-8)
  total = np.asarray(p_low).sum(-1) + np.asarray(p_extra).sum(-1)                # [B, K, P]
  np.testing.assert_allclose(total, 1.0, rtol=1e-5)
  assert not np.allclose(np.asarray(p_low[:, :, 0]), np.asarray(p_low[:, :, -1]))


def test_mixed_attention_without_lowbit_values_never_reads_them():
  """lowbit_values=False: value codes of 255 and NaN value scales change nothing."""
  args = list(_mixed_inputs(1, 32, 4, 2, 64, jnp.float32))
  kw = dict(prob_rows=2, lowbit_values=False)
  got, want = _run_mixed(tuple(args), 1, 32, 64, **kw)
  args[4], args[5], args[6] = (jnp.full_like(args[4], 255), jnp.full_like(args[5], jnp.nan),
                               jnp.full_like(args[6], jnp.nan))
  poisoned, _ = _run_mixed(tuple(args), 1, 32, 64, **kw)
  for g, p in zip(got, poisoned):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(p))


def test_mixed_attention_fully_masked_row_gives_zero():
  args = list(_mixed_inputs(2, 32, 3, 2, 64, jnp.float32, lengths=(0, 77, 600)))
  args[11] = args[11].at[0].set(False)                  # row 0: no low-bit slot, no extra column
  got, want = _run_mixed(tuple(args), 2, 32, 64)
  for name, g, w in zip(("out", "lowbit_probs", "extra_probs"), got, want):
    _check(name, g, w, jnp.float32)
  assert not np.asarray(got[0])[0].any() and not np.asarray(got[1])[0].any() and not np.asarray(got[2])[0].any()


# ------------------------------------------------------------------------------------------------------------
# validation

@pytest.mark.parametrize("make,message", [
    (lambda: QuantScoresTPUBlock(block_s=200), "block_s=200 must be a positive multiple of 128"),
    (lambda: MixedAttentionTPUBlock(block_s=64), "block_s=64 must be a positive multiple of 128"),
])
def test_block_validation(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_layout_validation_names_the_values():
  args = testing.quant_scores_inputs(0, batch=1, t=1, kv_heads=1, gqa=1, slots=256, head_dim=64, bits=2,
                                     group_size=64, lengths=(100,))
  with pytest.raises(ValueError, match="block_s=256 must hold a multiple of 8 key groups of group_size=64"):
    quant_scores(*args, bits=2, group_size=64, sm_scale=1.0, interpret=True, block=QuantScoresTPUBlock(256))
  args = _mixed_inputs(2, 32, 1, 2, 64, jnp.float32)
  with pytest.raises(ValueError, match="prob_rows=3 must be None or an int in"):
    mixed_decode_attention(*args, bits=2, group_size=32, sm_scale=1.0, interpret=True, prob_rows=3,
                           block=MixedAttentionTPUBlock(256))


# ------------------------------------------------------------------------------------------------------------
# lowering for the tpu platform

LOWER_SLOTS = 1000          # not a multiple of any block: the tail must lower too


def _key_args(b, kh, head_dim, bits, group_size, dtype):
  n_groups = -(-LOWER_SLOTS // group_size)
  return (SDS((b, kh, LOWER_SLOTS, head_dim * bits // 8), jnp.uint8), SDS((b, kh, n_groups, head_dim), dtype),
          SDS((b, kh, n_groups, head_dim), dtype))


def _quant_scores_call(bits, group_size, gqa, t, head_dim, dtype, **_):
  b, kh = 2, 8
  args = ((SDS((b, t, kh, gqa, head_dim), dtype),) + _key_args(b, kh, head_dim, bits, group_size, dtype)
          + (SDS((b,), jnp.int32),))
  return jax.jit(functools.partial(quant_scores, bits=bits, group_size=group_size, sm_scale=0.125)), args


def _mixed_call(bits, group_size, gqa, t, head_dim, dtype, prob_rows=None, lowbit_values=True):
  b, kh, x, e = 2, 8, 64, 130
  v_groups = head_dim // group_size
  args = ((SDS((b, t, kh * gqa, head_dim), dtype),) + _key_args(b, kh, head_dim, bits, group_size, dtype)
          + (SDS((b, kh, LOWER_SLOTS, head_dim * bits // 8), jnp.uint8), SDS((b, kh, LOWER_SLOTS, v_groups), dtype),
             SDS((b, kh, LOWER_SLOTS, v_groups), dtype), SDS((b,), jnp.int32), SDS((b, kh, x), jnp.int32),
             SDS((b, kh, e, head_dim), dtype), SDS((b, kh, e, head_dim), dtype), SDS((b, kh, t, e), jnp.bool_)))
  fn = functools.partial(mixed_decode_attention, bits=bits, group_size=group_size, sm_scale=0.125,
                         prob_rows=prob_rows, lowbit_values=lowbit_values)
  return jax.jit(fn), args


LOWER_CASES = [
    pytest.param(*c, id=_id(bits=c[0], group_size=c[1], gqa=c[2], t=c[3], head_dim=c[4], dtype=c[5],
                            prob_rows=c[6], lowbit_values=c[7]))
    for c in [(1, 32, 4, 4, 128, jnp.bfloat16, 3, True), (2, 64, 3, 1, 64, jnp.float32, None, False),
              (2, 32, 3, 2, 64, jnp.bfloat16, None, True)]]


@pytest.mark.parametrize("make_call", [_quant_scores_call, _mixed_call], ids=["quant_scores", "mixed"])
@pytest.mark.parametrize("bits,group_size,gqa,t,head_dim,dtype,prob_rows,lowbit_values", LOWER_CASES)
def test_lowers_for_tpu_with_mosaic(make_call, bits, group_size, gqa, t, head_dim, dtype, prob_rows, lowbit_values):
  fn, args = make_call(bits, group_size, gqa, t, head_dim, dtype, prob_rows=prob_rows, lowbit_values=lowbit_values)
  text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  assert MOSAIC_CALL in text          # the kernel became a Mosaic custom call with its module embedded


@pytest.mark.parametrize("make_call", [_quant_scores_call, _mixed_call], ids=["quant_scores", "mixed"])
def test_exports_for_tpu(make_call):
  fn, args = make_call(1, 32, 3, 4, 128, jnp.bfloat16, prob_rows=3)
  exported = jax.export.export(fn, platforms=["tpu"])(*args)
  assert exported.platforms == ("tpu",)
  assert MOSAIC_CALL in exported.mlir_module()
