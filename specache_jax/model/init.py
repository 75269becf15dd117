"""Random parameters in the checkpoint layout of docs/design.md (tests, training from scratch)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specache_jax.model_config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict:
  """The exact shape of every leaf a checkpoint must provide for `cfg`."""
  L, D, N, K, H, F, V = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
                         cfg.vocab_size)
  layers = {"attn_norm": (L, D), "wq": (L, D, N * H), "wk": (L, D, K * H), "wv": (L, D, K * H),
            "wo": (L, N * H, D), "mlp_norm": (L, D), "w_gate": (L, D, F), "w_up": (L, D, F),
            "w_down": (L, F, D)}
  if cfg.qkv_bias:
    layers.update(bq=(L, N * H), bk=(L, K * H), bv=(L, K * H))
  shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


def init_params(cfg: ModelConfig, rng, dtype=jnp.float32, scale: float = 0.02) -> dict:
  shapes = param_shapes(cfg)
  flat, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(rng, len(flat))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
  leaves = []
  for key, shape, path in zip(keys, flat, paths):
    if "norm" in path:
      leaves.append(1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32))
    else:
      leaves.append(scale * jax.random.normal(key, shape, jnp.float32))
  return jax.tree.map(lambda x: x.astype(dtype), jax.tree.unflatten(treedef, leaves))
