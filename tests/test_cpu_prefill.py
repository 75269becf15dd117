"""The XLA:CPU causal prefill attention kernel (`cpu_kernels.prefill_attention`) against the dense float32
references (its own and `attention.prefill_attention_reference`), and a model's prefill through it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import cpu_kernels as ck
from specache_jax.caches import attention as A
from specache_jax.cpu_kernels import prefill_attention as cpa
from specache_jax.model import decoder
from tests.tiny import random_prompts, tiny_model

needs_kernel = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels {ck.status()}")


def _inputs(seed, batch, t, n_kv, group, head_dim):
  rs = np.random.RandomState(seed)
  shapes = ((batch, t, n_kv * group, head_dim), (batch, t, n_kv, head_dim), (batch, t, n_kv, head_dim))
  return tuple(jnp.asarray(rs.randn(*s), jnp.float32) for s in shapes)


CASES = [  # batch, t, n_kv, group, head_dim, lengths
    (3, 300, 3, 3, 64, [300, 1, 171]),        # SmolLM2's heads; T not a multiple of 64 or 256; a length-1 row
    (2, 64, 1, 1, 128, [64, 63]),             # one query block, head_dim 128, G = 1
    (1, 600, 2, 4, 64, [600]),                # several key blocks (256) and a partial last one
    (4, 17, 2, 2, 64, [17, 3, 9, 16]),        # below one block, every row ragged
]


@needs_kernel
@pytest.mark.parametrize("batch, t, n_kv, group, head_dim, lengths", CASES, ids=lambda x: str(x).replace(" ", ""))
def test_kernel_equals_dense_references(batch, t, n_kv, group, head_dim, lengths):
  """Every row, padding rows included (they attend to their whole prompt)."""
  q, k, v = _inputs(t + batch, batch, t, n_kv, group, head_dim)
  lengths = jnp.asarray(lengths, jnp.int32)
  scale = head_dim ** -0.5
  got = jax.jit(functools.partial(cpa.causal_attention, sm_scale=scale))(q, k, v, lengths)
  assert got.shape == q.shape and got.dtype == q.dtype
  want = cpa.causal_attention_reference(q, k, v, lengths, scale)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
  dense, _ = A.prefill_attention_reference(q, k, v, lengths, scale, False)
  np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=2e-5, rtol=0)
  blockwise, _ = A.prefill_attention_blockwise(q, k, v, lengths, scale, False)
  np.testing.assert_allclose(np.asarray(got), np.asarray(blockwise), atol=2e-5, rtol=0)


@needs_kernel
def test_kernel_gives_zeros_for_an_empty_prompt_and_names_bad_inputs():
  q, k, v = _inputs(1, 2, 40, 1, 2, 64)
  out = cpa.causal_attention(q, k, v, jnp.asarray([0, 40], jnp.int32), 0.1)
  assert not np.asarray(out)[0].any() and np.isfinite(np.asarray(out)).all()
  with pytest.raises(ValueError, match="multiple of 64"):
    cpa.causal_attention(q[..., :32], k[..., :32], v[..., :32], jnp.asarray([1, 1]), 0.1)
  with pytest.raises(ValueError, match="lengths must be"):
    cpa.causal_attention(q, k, v, jnp.asarray([1, 1, 1]), 0.1)
  with pytest.raises(ValueError, match="multiple of K"):
    cpa.causal_attention(q[:, :, :1], k.repeat(2, axis=2), v.repeat(2, axis=2), jnp.asarray([1, 1]), 0.1)


@needs_kernel
def test_prefill_takes_the_kernel_on_cpu_only_and_logits_agree():
  """A model's prefill (ragged batch) with the kernel and with the blockwise jnp form: the same logits and cache;
  the column sums (H2O) keep the blockwise form; lowered for a GPU there is no custom call."""
  model = tiny_model(seed=5, head_dim=64)
  cfg = model.config
  prompts = random_prompts(3, [90, 41], cfg.vocab_size)
  tokens = jnp.asarray([p + [0] * (90 - len(p)) for p in prompts], jnp.int32)
  lengths = jnp.asarray([90, 41], jnp.int32)
  method = sj.cache_config("full")
  cache = sj.decode.init_cache(method, cfg, 2, 128, jnp.float32)

  def run(tokens, cache):
    return decoder.forward(model.params, cfg, tokens, cache, method, "prefill", prompt_lengths=lengths)[:2]

  assert ck.PREFILL_TARGET in jax.jit(run).trace(tokens, cache).lower().as_text()
  gpu = jax.jit(run).trace(tokens, cache).lower(lowering_platforms=("cuda",)).as_text()
  assert ck.PREFILL_TARGET not in gpu
  got = jax.jit(run)(tokens, cache)
  saved = cpa.applies
  cpa.applies = lambda head_dim: False
  try:
    off = jax.jit(lambda t, c: run(t, c))
    assert ck.PREFILL_TARGET not in off.trace(tokens, cache).lower().as_text()
    want = off(tokens, cache)
  finally:
    cpa.applies = saved
  valid = np.arange(90)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(np.asarray(got[0])[valid], np.asarray(want[0])[valid], rtol=1e-4, atol=1e-4)
  lowered = jax.jit(lambda q, k, v, n: A.prefill_attention(q, k, v, n, 0.125, True)).trace(
      *_inputs(2, 1, 70, 1, 2, 64), jnp.asarray([70])).lower().as_text()
  assert ck.PREFILL_TARGET not in lowered


@needs_kernel
def test_kernel_on_a_mesh_keeps_the_batch_sharded():
  from jax.sharding import NamedSharding, PartitionSpec as P
  from specache_jax import sharding
  mesh = sharding.make_mesh(2, 2)
  q, k, v = _inputs(3, 4, 70, 2, 2, 64)
  lengths = jnp.asarray([70, 12, 1, 55], jnp.int32)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))
  fn = jax.jit(functools.partial(cpa.causal_attention, sm_scale=0.125))
  args = [put(x) for x in (q, k, v, lengths)]
  assert ck.PREFILL_TARGET in fn.lower(*args).compile().as_text()
  got = fn(*args)
  assert got.sharding.spec[0] == "data"
  np.testing.assert_allclose(np.asarray(got), np.asarray(cpa.causal_attention_reference(q, k, v, lengths, 0.125)),
                             atol=2e-5, rtol=0)
