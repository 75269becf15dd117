"""Generation on a (data, model) mesh of 8 forced CPU devices: the same tokens as on one device, for full, KIVI
and SpeCache (simulated and offloaded), with the cache's per-device bytes shrinking as the mesh grows."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import specache_jax as sj
from specache_jax import decode, sharding
from specache_jax.caches import METHOD_NAMES, config_class
from specache_jax.model.init import param_shapes
from specache_jax.runtime import OffloadRuntime
from tests.tiny import random_prompts, tiny_model

LENGTHS = [29, 13, 22, 9]          # a ragged batch of 4 (data=2 splits it, data=4 too)
NEW = 8
METHODS = {
    "full": dict(),
    "kivi": dict(bits=2, group_size=8, residual=16),
    "specache": dict(bits=1, group_size=8, residual=8, topk=4),
}


@functools.lru_cache(maxsize=None)
def _model():
  return tiny_model(seed=11, head_dim=16, n_heads=4, n_kv_heads=2, ffn_dim=32)


@functools.lru_cache(maxsize=None)
def _unsharded(name: str):
  model = _model()
  prompts = random_prompts(5, LENGTHS, model.config.vocab_size)
  return np.asarray(sj.generate(model, prompts, max_new_tokens=NEW, stop_tokens=(),
                                cache=sj.cache_config(name, **METHODS[name])).tokens)


def test_make_mesh_axes_and_errors():
  mesh = sharding.make_mesh(2, 4)
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  assert tuple(mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
  assert sharding.make_mesh(1, 2).devices.size == 2
  with pytest.raises(ValueError, match=r"data=4 x model=4 needs 16 devices; only 8"):
    sharding.make_mesh(4, 4)
  with pytest.raises(ValueError, match=r"model=0 must be an integer >= 1"):
    sharding.make_mesh(2, 0)
  assert sharding.maybe_initialize_distributed(False) is False


@pytest.mark.parametrize("qkv_bias,tie", [(False, False), (True, True)])
def test_param_specs_cover_every_param_and_split_heads_and_mlp(qkv_bias, tie):
  model = tiny_model(seed=1, head_dim=16, n_heads=4, n_kv_heads=2, ffn_dim=32, qkv_bias=qkv_bias,
                     tie_embeddings=tie)
  cfg = model.config
  specs = sharding.param_specs(cfg)
  is_p = lambda x: isinstance(x, P)
  assert jax.tree.structure(specs, is_leaf=is_p) == jax.tree.structure(
      param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  mesh = sharding.make_mesh(2, 2)
  params = sharding.shard_params(model.params, cfg, mesh)
  lay = params["layers"]
  # model=2 halves the head / hidden dim on each device, data replicates
  assert lay["wq"].addressable_shards[0].data.shape == (cfg.n_layers, cfg.dim, cfg.n_heads * cfg.head_dim // 2)
  assert lay["wk"].addressable_shards[0].data.shape == (cfg.n_layers, cfg.dim, cfg.n_kv_heads * cfg.head_dim // 2)
  assert lay["wo"].addressable_shards[0].data.shape == (cfg.n_layers, cfg.n_heads * cfg.head_dim // 2, cfg.dim)
  assert lay["w_up"].addressable_shards[0].data.shape == (cfg.n_layers, cfg.dim, cfg.ffn_dim // 2)
  assert lay["w_down"].addressable_shards[0].data.shape == (cfg.n_layers, cfg.ffn_dim // 2, cfg.dim)
  assert params["embed"].addressable_shards[0].data.shape == params["embed"].shape
  if qkv_bias:
    assert lay["bk"].addressable_shards[0].data.shape == (cfg.n_layers, cfg.n_kv_heads * cfg.head_dim // 2)


def _settings(name):
  return METHODS.get(name, {"budget": 32} if name in ("streaming", "h2o") else {})


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_cache_specs_put_batch_on_data_and_kv_heads_on_model(name):
  try:
    method = config_class(name)(**_settings(name))
  except (ImportError, ModuleNotFoundError):
    pytest.skip(f"cache method {name} is not implemented yet")
  cfg = _model().config
  cache = jax.eval_shape(lambda: decode.init_cache(method, cfg, 4, 64, jnp.float32))
  specs = sharding.cache_specs(cache, cfg.n_kv_heads)
  assert specs.lengths == P("data")
  for leaf, spec in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(specs.layers, is_leaf=lambda x: isinstance(x, P))):
    assert spec[:2] == (None, "data")                 # [L, B, ...]
    if leaf.ndim >= 4:                                # [L, B, K, ...]
      assert leaf.shape[2] == cfg.n_kv_heads and spec[2] == "model", (leaf.shape, spec)
    else:                                             # [L, B, X]: per row, shared by heads
      assert len(spec) < 3 or spec[2] is None
  with pytest.raises(ValueError, match=r"has 3 on its KV-head axis, not n_kv_heads=2"):
    sharding.layer_leaf_spec((2, 4, 3, 8, 16), n_kv_heads=2)


@pytest.mark.parametrize("name", list(METHODS))
def test_per_device_cache_bytes_shrink_with_the_mesh(name):
  """Leaves [L, B, K, ...] shrink with data × model; per-row leaves [L, B] (SpeCache's miss flag) with data only."""
  cfg = _model().config
  method = sj.cache_config(name, **METHODS[name])
  cache = decode.init_cache(method, cfg, 4, 64, jnp.float32)
  leaves = jax.tree.leaves(cache.layers)
  assert sum(x.nbytes for x in leaves if x.ndim >= 4) > 0.99 * sharding.per_device_nbytes(cache.layers)
  for d, m in [(1, 2), (2, 1), (2, 2)]:
    expected = sum(x.nbytes // (d * (m if x.ndim >= 4 else 1)) for x in leaves)
    got = sharding.per_device_nbytes(sharding.shard_cache(cache, sharding.make_mesh(d, m)).layers)
    assert got == expected, (d, m, got, expected)


def test_prefill_on_the_mesh_keeps_the_cache_sharded():
  """What generate_jit starts decoding from: SpeCache's state after the prompt, a quarter per device."""
  model = _model()
  cfg, method = model.config, sj.cache_config("specache", **METHODS["specache"])
  toks, lens = sj.pad_prompts(random_prompts(5, LENGTHS, cfg.vocab_size))
  mesh = sharding.make_mesh(2, 2)
  params = sharding.shard_params(model.params, cfg, mesh)
  toks_d, lens_d = sharding.shard_batch(mesh, toks, lens)
  cache = decode.prefill_cache(params, toks_d, lens_d, cfg=cfg, method=method, max_len=64, mesh=mesh)
  for leaf in jax.tree.leaves(cache.layers):
    if leaf.size == 0:                    # holds nothing (SpeCache's spec_q without drift/track_hits): XLA replicates it
      continue
    want = (None, "data", "model") if leaf.ndim >= 4 else (None, "data")    # [L, B, K, ...] or per row [L, B]
    assert leaf.sharding.spec[:len(want)] == want, leaf.sharding
  st = cache.layers
  assert sharding.per_device_nbytes(st) == sum(x.nbytes // (4 if x.ndim >= 4 else 2) for x in jax.tree.leaves(st))
  assert st.kappa.addressable_shards[0].data.shape == (cfg.n_layers, 2, 1, method.topk)


@pytest.mark.parametrize("name,data,model", [("full", 2, 1), ("kivi", 1, 2), ("specache", 2, 2)],
                         ids=lambda x: str(x))
def test_sharded_generation_equals_unsharded(name, data, model):
  mdl = _model()
  prompts = random_prompts(5, LENGTHS, mdl.config.vocab_size)
  out = sj.generate(mdl, prompts, max_new_tokens=NEW, stop_tokens=(), mesh=sharding.make_mesh(data, model),
                    cache=sj.cache_config(name, **METHODS[name]))
  batch_axis = (tuple(out.tokens.sharding.spec) + (None,))[0]   # P() and P(None, ...) both say "not sharded"
  assert batch_axis == ("data" if data > 1 else None)
  np.testing.assert_array_equal(np.asarray(out.tokens), _unsharded(name))


@pytest.mark.parametrize("store", ["pinned_host", "numpy"])
def test_offloaded_on_mesh_equals_unsharded_and_shards_the_host_store(store):
  mdl = _model()
  cfg = mdl.config
  toks, lens = sj.pad_prompts(random_prompts(5, LENGTHS, cfg.vocab_size))
  mesh = sharding.make_mesh(2, 2)
  method = sj.cache_config("specache", offload=True, host_store=store, **METHODS["specache"])
  rt = OffloadRuntime(mdl.params, cfg, method, 4, decode.slots_for(max(LENGTHS) + NEW, method.speculation.width),
                      mesh=mesh)
  out = rt.generate(toks, lens, NEW, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens), _unsharded("specache"))
  for st in rt.states:
    for leaf in jax.tree.leaves(st):
      if leaf.size:
        want = ("data", "model") if leaf.ndim >= 3 else ("data",)   # [B, K, ...] or per row [B]
        assert leaf.sharding.spec[:len(want)] == want and leaf.sharding.memory_kind == "device", leaf.sharding
    assert st.fetched_k.addressable_shards[0].data.shape == (2, 1, method.topk, cfg.head_dim)
  if store == "pinned_host":
    for a in rt.store.arrays():
      assert a.sharding.memory_kind == "pinned_host"
      assert a.addressable_shards[0].data.nbytes * 4 == a.nbytes
  else:
    via_api = sj.generate(mdl, toks, lengths=lens, max_new_tokens=NEW, stop_tokens=(), cache=method, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(via_api.tokens), _unsharded("specache"))
