"""specache_jax.dispatch: "auto" follows the platform a program is lowered for; explicit kernel families are
refused off their backend or layout; every family gives the jnp path's tokens (the robust preset's several
speculative rows and KIVI included)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specache_jax as sj
from experiments.lib import export
from specache_jax import cpu_kernels as ck
from specache_jax import dispatch
from specache_jax.decode import init_cache
from specache_jax.errors import ConfigError
from specache_jax.model import decoder
from tests.tiny import random_prompts, tiny_model

SMALL = dict(bits=2, group_size=8, residual=8, topk=4)
METHODS = {"specache": dict(name="specache", **SMALL),
           "specache_robust": dict(name="specache", preset="robust", **SMALL),
           "kivi": dict(name="kivi", bits=2, group_size=8, residual=8)}


def _model():
  return tiny_model(seed=4, head_dim=16)


def _decode_text(method, platform: str) -> str:
  """The StableHLO of one decoding step (prefilled cache) lowered for `platform`."""
  model = _model()
  cfg = model.config
  cache = jax.eval_shape(lambda: init_cache(method, cfg, 2, 64, jnp.float32))
  width = method.speculation.width if method.name == "specache" else 1
  inp = jax.ShapeDtypeStruct((2, width), jnp.int32)
  fn = jax.jit(lambda p, i, c: decoder.forward(p, cfg, i, c, method, "decode")[:2])
  lowered = lambda: fn.trace(model.params, inp, cache).lower(lowering_platforms=(platform,)).as_text()  # noqa
  if platform == "cuda":
    with export._cuda_target():
      return lowered()
  return lowered()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_auto_takes_the_kernel_of_the_lowering_platform(name):
  method = sj.cache_config(**METHODS[name])
  assert method.attention_impl == "auto"
  calls = {p: export.custom_calls(_decode_text(method, p)) for p in ("cuda", "tpu", "cpu")}
  assert export.kernel_family(calls["cuda"]) == "triton"
  assert export.kernel_family(calls["tpu"]) == "mosaic"
  assert export.kernel_family(calls["cpu"]) is None
  if ck.available():
    assert ck.ATTENTION_TARGET in calls["cpu"]
    assert ck.ATTENTION_TARGET not in calls["cuda"] + calls["tpu"]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_jnp_takes_no_kernel_anywhere(name):
  method = sj.cache_config(**METHODS[name], attention_impl="jnp")
  for platform in ("cuda", "tpu", "cpu"):
    calls = export.custom_calls(_decode_text(method, platform))
    assert export.kernel_family(calls) is None and ck.ATTENTION_TARGET not in calls, (platform, calls)


@pytest.mark.parametrize("impl,platform", [("pallas", "cpu"), ("pallas", "tpu"), ("pallas_tpu", "cuda"),
                                           ("pallas_tpu", "cpu"), ("cpu", "cuda"), ("cpu", "tpu")])
def test_an_explicit_family_is_refused_off_its_backend(impl, platform):
  with pytest.raises(ConfigError, match=f"attention_impl='{impl}' runs on"):
    dispatch.check_backend(impl, platform)


@pytest.mark.parametrize("impl,platform", [("pallas", "gpu"), ("pallas", "cuda"), ("pallas_tpu", "tpu"),
                                           ("auto", "cpu"), ("auto", "rocm"), ("jnp", "tpu"),
                                           ("pallas_interpret", "cpu"), ("pallas_tpu_interpret", "cpu")])
def test_a_family_its_backend_runs_is_accepted(impl, platform):
  dispatch.check_backend(impl, platform)


def test_generate_refuses_a_family_the_backend_cannot_run():
  model = _model()
  cache = sj.cache_config("kivi", bits=2, group_size=8, residual=8, attention_impl="pallas_tpu")
  if jax.default_backend() == "tpu":
    pytest.skip("the TPU backend runs pallas_tpu")
  with pytest.raises(ConfigError, match="attention_impl='pallas_tpu' runs on tpu only"):
    sj.generate(model, random_prompts(1, [9], model.config.vocab_size), max_new_tokens=2, cache=cache)


def test_an_explicit_family_is_refused_for_a_layout_its_kernel_does_not_take():
  with pytest.raises(ConfigError, match="attention_impl='pallas': its mixed attention kernel does not take"):
    dispatch.check_layout("pallas", 2, 24, 96)                      # Triton: powers of two only
  with pytest.raises(ConfigError, match="attention_impl='pallas_tpu_interpret'"):
    dispatch.check_layout("pallas_tpu_interpret", 1, 4, 12)         # 12 one-bit codes: not whole bytes
  dispatch.check_layout("auto", 2, 24, 96)
  assert dispatch.tpu_supports(2, 128, 128) and dispatch.tpu_block(128).block_s == 1024   # 8 groups of 128
  with pytest.raises(ConfigError, match="must be one of"):
    sj.cache_config("specache", attention_impl="triton")


@pytest.mark.parametrize("name,impl", [("specache_robust", "pallas_interpret"), ("kivi", "pallas_interpret"),
                                       ("specache_robust", "pallas_tpu_interpret"), ("kivi", "pallas_tpu_interpret"),
                                       ("specache_robust", "auto"), ("kivi", "auto")])
def test_every_family_gives_the_jnp_tokens(name, impl):
  """The robust preset (3 speculative candidates: the kernels' prob_rows=3) and KIVI through the Triton and the
  Mosaic TPU kernels in interpret mode and through "auto" (on the CPU: the XLA:CPU kernel) decode the jnp path's
  tokens."""
  model = _model()
  prompts = random_prompts(7, [21, 34], model.config.vocab_size)
  run = lambda i: sj.generate(model, prompts, max_new_tokens=6, stop_tokens=(),  # noqa: E731
                              cache=sj.cache_config(**METHODS[name], attention_impl=i)).tokens
  np.testing.assert_array_equal(run(impl), run("jnp"))
