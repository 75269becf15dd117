"""Scale-out on a device mesh: a ("data", "model") mesh and partition specs for params and every cache state.

JAX's SPMD partitioner is the engine: params and the cache carry `NamedSharding`s and jit propagates them; the
decode loop only pins the cache's layout (`constrain_cache`). The layout is Megatron-style:
  data   the batch B (tokens, lengths, every cache leaf's B axis);
  model  attention heads — wq/wk/wv (and their biases) on their output N*H / K*H dim, wo on its input N*H dim —
         the MLP hidden F (w_gate/w_up output, w_down input), and the KV heads K of every cache leaf.
SpeCache picks its top-k per KV head, so κ, the low-bit copy, the residual ring, the fetched rows and the
16-bit host store all shard with the heads: no step of the method crosses the model axis.
embed, the norms and lm_head stay replicated (the LM head's output is what sampling reads whole).
Axis letters as in docs/design.md.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specache_jax import multiprocess
from specache_jax.caches.base import Cache
from specache_jax.model_config import ModelConfig

AXES = ("data", "model")


def maybe_initialize_distributed(flag: bool, **kwargs) -> bool:
  """Launchers: `multiprocess.initialize(**kwargs)` when `flag` (before any jax op)."""
  if not flag:
    return False
  multiprocess.initialize(**kwargs)
  return True


def make_mesh(data: int, model: int, devices=None) -> Mesh:
  """A (data, model) mesh with Auto axes over the first data*model devices (or the given ones)."""
  for name, value in (("data", data), ("model", model)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be an integer >= 1 (mesh axis size)")
  devices = list(jax.devices() if devices is None else devices)
  need = data * model
  if len(devices) < need:
    raise ValueError(f"a mesh of data={data} x model={model} needs {need} devices; only {len(devices)} "
                     f"are available ({devices[0].platform if devices else 'none'})")
  return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=devices[:need])


def first_local_device(mesh: Mesh):
  """The mesh's first device of this process (per-device queries such as memory stats need an addressable one)."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if not local:
    raise ValueError(f"the mesh {dict(mesh.shape)} holds no device of process {jax.process_index()}")
  return local[0]


def local_block(x, b: slice, k: slice, k_axis: int) -> np.ndarray:
  """Rows b, KV heads k (on axis k_axis, B on axis 0) of a (sharded) jax or numpy array, read from a shard of
  this process that holds them: never a cross-process transfer."""
  if isinstance(x, np.ndarray):
    return x[(b,) + (slice(None),) * (k_axis - 1) + (k,)]
  for shard in x.addressable_shards:
    sb, sk = shard.index[0], shard.index[k_axis]
    b0, b1, _ = sb.indices(x.shape[0])
    k0, k1, _ = sk.indices(x.shape[k_axis])
    if b0 <= b.start and b.stop <= b1 and k0 <= k.start and k.stop <= k1:
      local = (slice(b.start - b0, b.stop - b0),) + (slice(None),) * (k_axis - 1) + \
          (slice(k.start - k0, k.stop - k0),)
      return np.asarray(shard.data)[local]
  raise ValueError(f"no shard of this process holds rows {b} and KV heads {k} of an array of shape {x.shape} "
                   f"laid out as {x.sharding}: a host store needs the cache's (data, model) layout")


def param_specs(cfg: ModelConfig) -> dict:
  """PartitionSpecs with the structure of `model.init.param_shapes(cfg)` (layer leaves lead with L)."""
  heads_out = P(None, None, "model")          # [L, D, N*H | K*H | F]: output dim by model
  heads_in = P(None, "model", None)           # [L, N*H | F, D]: input dim by model
  layers = {"attn_norm": P(None, None), "mlp_norm": P(None, None),
            "wq": heads_out, "wk": heads_out, "wv": heads_out, "wo": heads_in,
            "w_gate": heads_out, "w_up": heads_out, "w_down": heads_in}
  if cfg.qkv_bias:
    layers.update(bq=P(None, "model"), bk=P(None, "model"), bv=P(None, "model"))
  specs = {"embed": P(None, None), "layers": layers, "final_norm": P(None)}
  if not cfg.tie_embeddings:
    specs["lm_head"] = P(None, None)
  return specs


def named(mesh: Mesh, specs, memory_kind: str | None = None):
  return jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=memory_kind), specs,
                      is_leaf=lambda x: isinstance(x, P))


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
  return jax.device_put(params, named(mesh, param_specs(cfg)))


def layer_leaf_spec(shape: tuple, n_kv_heads: int | None = None, stacked: bool = True) -> P:
  """A cache state leaf: [L, B, ...] when `stacked` (the decode loop), [B, ...] per layer (the runtime).

  Per layer, a leaf of rank >= 3 is [B, K, ...] (docs/design.md's cache layouts: 16-bit K/V, codes, scales, rings,
  κ, fetched rows, H2O's scores): B on "data", K on "model". Rank 2 is per row and slot, shared by the heads
  ([B, X], StreamingLLM's positions): B only. Rank 1 is [B]. With `n_kv_heads` given, a rank >= 3 leaf whose
  K axis has another size is an error, not a silent mis-shard.
  """
  lead = (None,) if stacked else ()
  rank = len(shape) - len(lead)
  if rank <= 0:
    return P(*lead)
  if rank <= 2:
    return P(*lead, "data", *([None] * (rank - 1)))
  k = shape[len(lead) + 1]
  if n_kv_heads is not None and k != n_kv_heads:
    raise ValueError(f"a cache leaf of shape {tuple(shape)} has {k} on its KV-head axis, not "
                     f"n_kv_heads={n_kv_heads}: per-layer state leaves must be [B, K, ...] (docs/design.md)")
  return P(*lead, "data", "model", *([None] * (rank - 2)))


def cache_specs(cache, n_kv_heads: int | None = None):
  """PartitionSpecs for a `Cache` (layers stacked [L, B, K, ...] or a per-layer tuple of [B, K, ...];
  lengths [B]) or a bare stacked state."""
  if isinstance(cache, Cache):
    return Cache(layers=cache_specs(cache.layers, n_kv_heads), lengths=P("data"),
                 tokens=None if cache.tokens is None else P("data", None))
  if isinstance(cache, (tuple, list)):
    return tuple(layer_state_specs(st, n_kv_heads) for st in cache)
  return jax.tree.map(lambda a: layer_leaf_spec(a.shape, n_kv_heads), cache)


def layer_state_specs(state, n_kv_heads: int | None = None):
  """PartitionSpecs for one layer's state (leaves [B, K, ...]) — a per-layer cache's or the offload runtime's."""
  return jax.tree.map(lambda a: layer_leaf_spec(a.shape, n_kv_heads, stacked=False), state)


def cache_shardings(cache, mesh: Mesh, n_kv_heads: int | None = None):
  return named(mesh, cache_specs(cache, n_kv_heads))


def shard_cache(cache, mesh: Mesh, n_kv_heads: int | None = None):
  return jax.device_put(cache, cache_shardings(cache, mesh, n_kv_heads))


def constrain_cache(cache, mesh: Mesh):
  """Inside jit: pin the cache to its (data, model) layout."""
  return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def shard_batch(mesh: Mesh, tokens_BT, lengths_B):
  """Tokens [B, T] and lengths [B] with B on "data"."""
  return (jax.device_put(np.asarray(tokens_BT), NamedSharding(mesh, P("data", None))),
          jax.device_put(np.asarray(lengths_B), NamedSharding(mesh, P("data"))))


def per_device_nbytes(tree) -> int:
  """Bytes the first device holds of a (sharded) pytree: what shrinks as the mesh grows."""
  return int(sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree)))
