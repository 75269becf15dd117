"""Validation in one place: the model config, the params, the cache config, the inputs and the mesh are checked
before anything is compiled. Every error names the value and the rule it broke.

`check_generate` is what `sj.generate` runs; `check_forward` what `sj.forward` runs. The per-object rules that
also run at construction (ModelConfig.validate, each cache config's __post_init__/validate) are re-run
here, so a config that was built some other way (dataclasses.replace, object.__setattr__, a pickled copy) is
still caught before compilation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specache_jax import buckets, decode, dispatch
from specache_jax.arrays import DTYPES
from specache_jax.caches.base import CacheConfig
from specache_jax.errors import ConfigError
from specache_jax.model.init import param_shapes
from specache_jax.model_config import ModelConfig


# ----- model config and params -----

def check_model_config(cfg) -> None:
  if not isinstance(cfg, ModelConfig):
    raise ConfigError(f"model config {cfg!r} must be a specache_jax ModelConfig")
  cfg.validate()


def _x64() -> bool:
  return bool(jax.config.jax_enable_x64)


def check_param_dtype(path: str, dtype) -> None:
  """A dtype the decoder can run on this backend: float32, bfloat16, float16; float64 only with x64."""
  name = jnp.dtype(dtype).name
  if name == "float64":
    if not _x64():
      raise ConfigError(f"param {path} has dtype=float64 but jax_enable_x64 is off, so JAX would silently run "
                        "it as float32: cast the params (e.g. to float32) or enable x64")
    return
  if name not in DTYPES:
    raise ConfigError(f"param {path} has dtype={name}, which the decoder cannot run; params must be one of "
                      f"{tuple(DTYPES)} (quantized checkpoints are dequantized on load)")


def check_params(params, cfg: ModelConfig) -> None:
  """Structure, shapes (model/init.param_shapes) and dtypes of the params."""
  want = param_shapes(cfg)
  if not isinstance(params, dict):
    raise ConfigError(f"params must be a nested dict (docs/design.md), got {type(params).__name__}")

  def walk(want_tree, got_tree, prefix):
    missing = sorted(set(want_tree) - set(got_tree))
    extra = sorted(set(got_tree) - set(want_tree))
    if missing:
      raise ConfigError(f"params{prefix} is missing {missing} required by the model config")
    if extra:
      raise ConfigError(f"params{prefix} has unexpected entries {extra} (cfg.tie_embeddings="
                        f"{cfg.tie_embeddings}, cfg.qkv_bias={cfg.qkv_bias})")
    for key, shape in want_tree.items():
      path, leaf = f"{prefix}[{key!r}]", got_tree[key]
      if isinstance(shape, dict):
        if not isinstance(leaf, dict):
          raise ConfigError(f"params{path} must be a dict of layer tensors")
        walk(shape, leaf, path)
        continue
      if tuple(leaf.shape) != tuple(shape):
        raise ConfigError(f"params{path} has shape {tuple(leaf.shape)}; the model config needs {tuple(shape)}")
      check_param_dtype(f"params{path}", leaf.dtype)

  walk(want, params, "")


# ----- inputs -----

def check_prompt_values(prompts) -> None:
  """Token ids must be integers (a float array would be truncated silently by the int32 cast)."""
  rows = prompts if isinstance(prompts, (list, tuple)) else [prompts]
  for row in rows:
    arr = np.asarray(row)
    if arr.size and arr.dtype.kind not in "iu":
      raise ValueError(f"tokens have dtype={arr.dtype} (e.g. {arr.ravel()[0]!r}); token ids must be integers")


def check_tokens(cfg: ModelConfig, tokens_BT, lengths_B, max_new_tokens: int = 0, extra: int = 0) -> None:
  """A right-padded batch: non-empty rows, lengths within the array, ids in the vocabulary, context fits."""
  tokens_BT, lengths_B = np.asarray(tokens_BT), np.asarray(lengths_B)
  if tokens_BT.ndim != 2 or tokens_BT.shape[0] == 0:
    raise ValueError(f"the batch is empty or not [B, T]: tokens has shape {tokens_BT.shape}")
  if lengths_B.shape != (tokens_BT.shape[0],):
    raise ValueError(f"lengths has shape {lengths_B.shape}; it needs one length per row: ({tokens_BT.shape[0]},)")
  if np.any(lengths_B <= 0):
    raise ValueError(f"empty prompt: prompt lengths {lengths_B.tolist()} must all be >= 1")
  if np.any(lengths_B > tokens_BT.shape[1]):
    raise ValueError(f"lengths {lengths_B.tolist()} exceed the token array width {tokens_BT.shape[1]}")
  valid = np.arange(tokens_BT.shape[1])[None, :] < lengths_B[:, None]
  bad = valid & ((tokens_BT < 0) | (tokens_BT >= cfg.vocab_size))
  if np.any(bad):
    r, c = np.argwhere(bad)[0]
    raise ValueError(f"token id {int(tokens_BT[r, c])} at row {r}, position {c} is outside the vocabulary "
                     f"[0, vocab_size={cfg.vocab_size})")
  need = int(lengths_B.max()) + max_new_tokens + extra
  if need > cfg.max_position:
    raise ValueError(f"prompt length {int(lengths_B.max())} + max_new_tokens {max_new_tokens}"
                     f"{f' + {extra}' if extra else ''} = {need} exceeds the model's context "
                     f"max_position={cfg.max_position}")


def check_sampling(max_new_tokens, temperature, top_p) -> None:
  if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
  if not temperature >= 0:
    raise ValueError(f"temperature={temperature} must be >= 0")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")


def check_stop_tokens(cfg: ModelConfig, stop_tokens) -> None:
  bad = [int(s) for s in stop_tokens if not 0 <= int(s) < cfg.vocab_size]
  if bad:
    raise ValueError(f"stop_tokens {bad} lie outside the vocabulary [0, vocab_size={cfg.vocab_size})")


# ----- cache config and mesh -----

def check_cache_config(method, cfg: ModelConfig, max_len: int, platform: str | None = None) -> None:
  """The cache config's rules, and its `attention_impl` against the backend (`dispatch.check_backend`; platform:
  jax.default_backend() when None): an explicit kernel family the backend cannot run is refused here."""
  if not isinstance(method, CacheConfig):
    raise ConfigError(f"cache={method!r} must be a cache method config from sj.cache_config(...) or a name")
  if hasattr(method, "__post_init__"):
    method.__post_init__()               # the construction-time rules (bits, group sizes, k >= 0, budgets)
  method.validate(cfg, max_len)          # the rules that need the model and the length (g | H, k <= slots)
  dispatch.check_backend(getattr(method, "attention_impl", "auto"), platform)


def check_mesh(mesh, cfg: ModelConfig, batch: int) -> None:
  """A ("data", "model") mesh whose axis sizes divide the batch and the heads / MLP hidden."""
  if not isinstance(mesh, Mesh):
    raise ConfigError(f"mesh={mesh!r} must be a jax.sharding.Mesh (see sharding.make_mesh)")
  sizes = dict(mesh.shape)
  if set(sizes) != {"data", "model"}:
    raise ConfigError(f"mesh axes {tuple(sizes)} must be exactly ('data', 'model') (sharding.make_mesh)")
  if batch % sizes["data"]:
    raise ConfigError(f"mesh data={sizes['data']} must divide the batch size {batch} (rows are split over it)")
  for name in ("n_kv_heads", "ffn_dim"):
    if getattr(cfg, name) % sizes["model"]:
      raise ConfigError(f"mesh model={sizes['model']} must divide {name}={getattr(cfg, name)} (the model axis "
                        "splits the KV heads and the MLP hidden)")


# ----- entry points -----

def check_forward(cfg: ModelConfig, params, tokens_BT, lengths_B) -> None:
  check_model_config(cfg)
  check_params(params, cfg)
  check_tokens(cfg, tokens_BT, lengths_B)


def check_buckets(policy) -> None:
  if policy is not None and not isinstance(policy, buckets.BucketPolicy):
    raise ConfigError(f"buckets={policy!r} must be a specache_jax.buckets.BucketPolicy or None (exact shapes)")
  if policy is not None:
    policy.__post_init__()


def check_generate(cfg: ModelConfig, params, method, tokens_BT, lengths_B, *, max_new_tokens: int,
                   temperature: float, top_p: float, stop_tokens=(), mesh=None,
                   policy: buckets.BucketPolicy | None = None) -> tuple[int, buckets.Shapes]:
  """Everything `sj.generate` needs, in the order a user would fix it. Returns (max_len: the cache slots, the
  compiled sizes: `buckets.plan` under `policy`; None: the exact lengths)."""
  check_model_config(cfg)
  if not isinstance(method, CacheConfig):
    raise ConfigError(f"cache={method!r} must be a cache method config from sj.cache_config(...) or a name")
  check_sampling(max_new_tokens, temperature, top_p)
  check_tokens(cfg, tokens_BT, lengths_B, max_new_tokens, method.speculation.width - 1)
  check_stop_tokens(cfg, stop_tokens)
  check_buckets(policy)
  shapes = buckets.plan(policy, np.asarray(tokens_BT).shape[1], int(np.max(lengths_B)), max_new_tokens,
                        cfg.max_position)
  max_len = decode.slots_for(shapes.slot_tokens, method.speculation.width)
  check_cache_config(method, cfg, max_len)
  check_params(params, cfg)
  if mesh is not None:
    check_mesh(mesh, cfg, np.asarray(tokens_BT).shape[0])
  return max_len, shapes
