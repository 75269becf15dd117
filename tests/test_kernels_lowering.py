"""Both kernels lower for CUDA on the CPU (Triton backend), so a kernel that cannot compile for a GPU fails CI.

Lowering runs the Pallas→Triton-IR translation (shape, dtype and op support are checked there; e.g. a
non-power-of-two tile or an unsupported primitive fails). The final Triton→PTX compilation happens in XLA on
a GPU and is not covered here. jax >= 0.11 takes the target's compute capability from the device (or an abstract
one): without a GPU here, the lowering names the lent machine's H200 (`_cuda_target`).
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mixed_decode_attention import MixedAttentionBlock
from pallas_kernels.mixed_decode_attention import mixed_decode_attention
from pallas_kernels.quant_scores import quant_scores

SDS = jax.ShapeDtypeStruct
TRITON_CALL = "__gpu$xla.gpu.triton"
SLOTS = 1000                # not a multiple of any block: the tail masking must lower too

CONFIGS = [
    pytest.param(bits, group_size, gqa, t, head_dim, dtype,
                 id=f"{bits=}_{group_size=}_{gqa=}_{t=}_{head_dim=}_dtype={jnp.dtype(dtype).name}")
    for bits, group_size, gqa, t, head_dim, dtype in [
        (1, 32, 4, 2, 128, jnp.bfloat16), (2, 64, 3, 2, 64, jnp.float16), (4, 32, 1, 1, 64, jnp.float32),
        (2, 32, 4, 1, 128, jnp.float32), (1, 64, 3, 1, 64, jnp.bfloat16)]
]


def _cuda_target():
  """An abstract mesh whose device is an H200 (sm_90): what Pallas' Triton lowering reads the target from."""
  gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu))


def _key_args(b, kh, head_dim, bits, group_size, dtype):
  n_groups = -(-SLOTS // group_size)
  return (SDS((b, kh, SLOTS, head_dim * bits // 8), jnp.uint8), SDS((b, kh, n_groups, head_dim), dtype),
          SDS((b, kh, n_groups, head_dim), dtype))


def _quant_scores_call(bits, group_size, gqa, t, head_dim, dtype):
  b, kh = 2, 8
  args = ((SDS((b, t, kh, gqa, head_dim), dtype),) + _key_args(b, kh, head_dim, bits, group_size, dtype)
          + (SDS((b,), jnp.int32),))
  return jax.jit(functools.partial(quant_scores, bits=bits, group_size=group_size, sm_scale=0.125)), args


def _mixed_call(bits, group_size, gqa, t, head_dim, dtype, prob_rows=None):
  b, kh, x, e = 2, 8, 64, 130
  v_groups = head_dim // group_size
  args = ((SDS((b, t, kh * gqa, head_dim), dtype),) + _key_args(b, kh, head_dim, bits, group_size, dtype)
          + (SDS((b, kh, SLOTS, head_dim * bits // 8), jnp.uint8), SDS((b, kh, SLOTS, v_groups), dtype),
             SDS((b, kh, SLOTS, v_groups), dtype), SDS((b,), jnp.int32), SDS((b, kh, x), jnp.int32),
             SDS((b, kh, e, head_dim), dtype), SDS((b, kh, e, head_dim), dtype),
             SDS((b, kh, t, e), jnp.bool_)))
  fn = functools.partial(mixed_decode_attention, bits=bits, group_size=group_size, sm_scale=0.125,
                         block=MixedAttentionBlock(block_s=64, num_splits=4), prob_rows=prob_rows)
  return jax.jit(fn), args


@pytest.mark.parametrize("make_call", [_quant_scores_call, _mixed_call], ids=["quant_scores", "mixed"])
@pytest.mark.parametrize("bits,group_size,gqa,t,head_dim,dtype", CONFIGS)
def test_lowers_for_cuda_with_triton(make_call, bits, group_size, gqa, t, head_dim, dtype):
  fn, args = make_call(bits, group_size, gqa, t, head_dim, dtype)
  with _cuda_target():
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert TRITON_CALL in text          # the kernel became a Triton custom call with its IR embedded


@pytest.mark.parametrize("t,prob_rows", [(4, 3), (3, 2)], ids=["t=4_prob_rows=3", "t=3_prob_rows=2"])
def test_lowers_for_cuda_with_several_rows(t, prob_rows):
  """SpeCache's candidates: T = 1 + candidates rows (T = 3 is padded to a power of two), the last rows'
  probabilities."""
  calls = [_quant_scores_call(1, 32, 3, t, 128, jnp.bfloat16), _mixed_call(1, 32, 3, t, 128, jnp.bfloat16, prob_rows)]
  for fn, args in calls:
    with _cuda_target():
      text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON_CALL in text


@pytest.mark.parametrize("make_call", [_quant_scores_call, _mixed_call], ids=["quant_scores", "mixed"])
def test_exports_for_cuda(make_call):
  fn, args = make_call(2, 32, 4, 2, 128, jnp.bfloat16)
  with _cuda_target():
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  assert exported.platforms == ("cuda",)
  assert TRITON_CALL in exported.mlir_module()
