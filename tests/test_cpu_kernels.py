"""The XLA:CPU skinny-matmul kernel against its float32 jnp reference, and where the model uses it."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from specache_jax import cpu_kernels as ck
from specache_jax import dispatch
from specache_jax.model import decoder
from tests.tiny import random_prompts, tiny_model

needs_kernel = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels {ck.status()}")


def _rand(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


@needs_kernel
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m", range(1, ck.MAX_ROWS + 1))
def test_skinny_matmul_matches_reference(m, transposed):
  # Odd sizes: D not a multiple of 4 or 16 (the kernels' unrolled steps), N not a multiple of 16, and N past
  # one column item (2048) and one row block (64), so every remainder path runs.
  rng = np.random.default_rng(1000 + 10 * m + transposed)
  for d, n in ((576, 1536), (67, 2083), (5, 3), (1536, 129)):
    x = _rand(rng, m, d)
    w = _rand(rng, n, d) if transposed else _rand(rng, d, n)
    got, = jax.jit(ck.skinny_matmul, static_argnums=2)(x, [w], transposed)
    want, = ck.skinny_matmul_reference(x, [w], transposed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=2e-6 * float(np.abs(want).max()) * np.sqrt(d))


@needs_kernel
@pytest.mark.parametrize("transposed", [False, True])
def test_several_weights_in_one_call_match_reference(transposed):
  """q/k/v-like weights of different widths (and one wider than a column item) share one call."""
  rng = np.random.default_rng(7 + transposed)
  x = _rand(rng, 2, 100)
  ws = [_rand(rng, n, 100) if transposed else _rand(rng, 100, n) for n in (64, 17, 2100, 1)]
  got = jax.jit(ck.skinny_matmul, static_argnums=2)(x, ws, transposed)
  want = ck.skinny_matmul_reference(x, ws, transposed)
  assert [g.shape for g in got] == [(2, 64), (2, 17), (2, 2100), (2, 1)]
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=2e-5 * float(np.abs(r).max()))


@needs_kernel
def test_skinny_matmul_names_bad_inputs():
  x, w = jnp.ones((2, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match="9 rows; the kernel takes 1 to 8"):
    ck.skinny_matmul(jnp.ones((9, 8)), [w])
  with pytest.raises(ValueError, match=r"\(2, 8\) and w \(7, 4\).*do not contract"):
    ck.skinny_matmul(x, [w, jnp.ones((7, 4))])
  with pytest.raises(ValueError, match="float32 only, got x bfloat16"):
    ck.skinny_matmul(x.astype(jnp.bfloat16), [w])
  with pytest.raises(ValueError, match="no weights given"):
    ck.skinny_matmul(x, [])


def _custom_calls(fn, *args, platform=None):
  lowered = jax.jit(fn).trace(*args).lower(**({"lowering_platforms": (platform,)} if platform else {}))
  return lowered.as_text().count(ck.TARGET)


@needs_kernel
def test_dense_takes_the_kernel_for_decoding_rows_only():
  rng = np.random.default_rng(0)
  w, head = _rand(rng, 64, 96), _rand(rng, 200, 64)
  proj = lambda x: dispatch.dense(x, w)
  tied = lambda x: dispatch.dense(x, head, transposed=True)
  assert _custom_calls(proj, _rand(rng, 1, 2, 64)) == 1            # SpeCache B=1: the real + speculative row
  assert _custom_calls(proj, _rand(rng, 4, 1, 64)) == 1
  assert _custom_calls(proj, _rand(rng, 1, 1, 64)) == 1            # one row (batch 1, full cache)
  assert _custom_calls(tied, _rand(rng, 1, 1, 64)) == 1
  assert _custom_calls(proj, _rand(rng, 1, 16, 64)) == 0           # a prompt
  assert _custom_calls(proj, _rand(rng, 1, 2, 64).astype(jnp.bfloat16)) == 0
  # Lowered for a GPU the CPU branch is not emitted (`platform_dependent`), so no unknown custom call there.
  assert _custom_calls(proj, _rand(rng, 1, 2, 64), platform="cuda") == 0
  qkv = lambda x: dispatch.dense(x, w, w[:, :7], w[:, :5])
  assert _custom_calls(qkv, _rand(rng, 1, 2, 64)) == 1            # one call for the three
  x = _rand(rng, 3, 1, 64)
  np.testing.assert_allclose(np.asarray(jax.jit(proj)(x)), np.asarray(jnp.einsum("btd,dn->btn", x, w)),
                             rtol=1e-5, atol=1e-5)


@needs_kernel
def test_decode_logits_equal_with_and_without_the_kernel():
  """The model's decoding forward (two sequences: two rows, and a tied LM head) with the kernels and with XLA's
  dots gives the same logits and cache."""
  model = tiny_model(seed=5, head_dim=16, tie_embeddings=True)
  cfg, method = model.config, sj.cache_config("full")
  prompts = random_prompts(1, [12, 9], cfg.vocab_size)
  tokens = jnp.asarray([p + [0] * (12 - len(p)) for p in prompts], jnp.int32)
  cache = decoder.per_layer(sj.decode.init_cache(method, cfg, 2, 32, jnp.float32), cfg.n_layers)
  _, cache, _ = decoder.forward_jit(model.params, cfg, tokens, cache, method, "prefill",
                                    jnp.asarray([12, 9], jnp.int32))
  step = jnp.asarray([[3], [5]], jnp.int32)

  def run(x, c):
    return decoder.forward(model.params, cfg, x, c, method, "decode")[:2]

  with_kernel = jax.jit(run)
  assert ck.TARGET in with_kernel.trace(step, cache).lower().as_text()
  without = jax.jit(lambda x, c: run(x, c))       # its own trace, made with the kernels off
  ck._load.cache_clear()
  try:
    os.environ[ck.ENV_SWITCH] = "0"
    assert ck.TARGET not in without.trace(step, cache).lower().as_text()
    want = without(step, cache)
  finally:
    os.environ.pop(ck.ENV_SWITCH)
    ck._load.cache_clear()
  got = with_kernel(step, cache)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_model_keeps_xla_dots(tmp_path):
  """No C++ compiler: `status()` says why and `dense` is XLA's dot (fresh process: the kernel is per process)."""
  code = ("import jax, jax.numpy as jnp\n"
          "from specache_jax import cpu_kernels as ck\n"
          "print(ck.available(), ck.status())\n"
          "x, w = jnp.ones((1, 2, 8)), jnp.ones((8, 4))\n"
          "from specache_jax import dispatch\n"
          "print(float(jax.jit(dispatch.dense)(x, w).sum()))\n")
  env = {"PATH": "/nonexistent", "CXX": "/bin/false", "SPECACHE_JAX_KERNEL_CACHE": str(tmp_path),
         "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  first, second = lines[0], lines[-1]
  assert first.startswith("False unavailable: compiling the CPU kernels failed (/bin/false"), first
  assert second == "64.0"


@needs_kernel
def test_dense_on_a_mesh_keeps_the_rows_sharded_and_gathers_sharded_weights():
  """custom_partitioning: rows split over "data" stay split; a weight split over "model" is gathered."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from specache_jax import sharding
  mesh = sharding.make_mesh(2, 2)
  rng = np.random.default_rng(3)
  x = jax.device_put(_rand(rng, 4, 1, 64), NamedSharding(mesh, P("data")))
  w = jax.device_put(_rand(rng, 64, 96), NamedSharding(mesh, P(None, "model")))
  fn = jax.jit(lambda x, w: dispatch.dense(x, w, w[:, :8]))
  assert ck.TARGET in fn.lower(x, w).compile().as_text()          # each device runs the kernel
  y, y8 = fn(x, w)
  assert y.sharding.spec[0] == "data"
  want = jnp.einsum("btd,dn->btn", x, w)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y8), np.asarray(want[..., :8]), rtol=1e-5, atol=1e-5)
