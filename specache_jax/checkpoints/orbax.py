"""Converted params on disk with orbax-checkpoint, plus the ModelConfig (and tokenizer) as files alongside.

A model directory written here holds `params/` (an orbax StandardCheckpointer tree), the tokenizer files when
there is a tokenizer, and `specache_model.json` (format, ModelConfig, dtype, source) — written last, so its
presence marks a complete save.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from specache_jax.checkpoints import CheckpointError, resolve_dtype
from specache_jax.model.init import param_shapes
from specache_jax.model_config import ModelConfig, RopeScaling
from specache_jax.tokenizer import Tokenizer

MARKER = "specache_model.json"
FORMAT = "specache_jax/params-v1"


def is_model_dir(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER))


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
  d = dataclasses.asdict(cfg)
  d["eos_token_ids"] = list(cfg.eos_token_ids)
  return d


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
  d = dict(d)
  d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
  d["eos_token_ids"] = tuple(int(e) for e in d.get("eos_token_ids", ()))
  try:
    return ModelConfig(**d)
  except TypeError as err:
    raise CheckpointError(f"the saved model config has unknown or missing fields: {err}") from err


def save(directory: str, cfg: ModelConfig, params: dict, tokenizer=None, source: str = "") -> str:
  """Write params (+ config, tokenizer) to `directory` (absolute-ized; overwritten if it exists)."""
  import orbax.checkpoint as ocp
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  marker = os.path.join(directory, MARKER)
  if os.path.exists(marker):
    os.remove(marker)   # the directory is incomplete until the new marker is written
  leaves = {str(np.dtype(x.dtype)) for x in _leaves(params)}
  checkpointer = ocp.StandardCheckpointer()
  try:
    checkpointer.save(os.path.join(directory, "params"), params, force=True)
    checkpointer.wait_until_finished()
  finally:
    checkpointer.close()
  if tokenizer is not None:
    tokenizer.save(directory)
  meta = {"format": FORMAT, "config": config_to_dict(cfg), "dtype": sorted(leaves), "source": source}
  with open(marker + ".tmp", "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  os.replace(marker + ".tmp", marker)
  return directory


def _leaves(tree) -> list:
  import jax
  return jax.tree.leaves(tree)


def read_meta(directory: str) -> dict[str, Any]:
  marker = os.path.join(directory, MARKER)
  if not os.path.isfile(marker):
    raise CheckpointError(f"{directory} is not a complete specache_jax model directory: {MARKER} is missing")
  try:
    with open(marker, encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as err:
    raise CheckpointError(f"{marker} is not valid JSON: {err}") from err
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{marker} has format={meta.get('format')!r}; expected {FORMAT!r}")
  return meta


def restore(directory: str, dtype=None) -> tuple[ModelConfig, dict, Any, str]:
  """-> (ModelConfig, params, Tokenizer | None, source). dtype None keeps the saved dtype, else casts."""
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  directory = os.path.abspath(directory)
  meta = read_meta(directory)
  cfg = config_from_dict(meta["config"])
  saved = resolve_dtype(meta["dtype"][0]) if meta.get("dtype") else np.dtype(np.float32)
  shapes = param_shapes(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, saved, sharding=device), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  checkpointer = ocp.StandardCheckpointer()
  try:
    params = checkpointer.restore(os.path.join(directory, "params"), target)
  except Exception as err:  # orbax / tensorstore raise many types for missing or damaged files
    raise CheckpointError(f"{directory}/params cannot be restored (damaged or written for another config): "
                          f"{type(err).__name__}: {err}") from err
  finally:
    checkpointer.close()
  for (path, leaf), (_, want) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                      jax.tree_util.tree_flatten_with_path(
                                          shapes, is_leaf=lambda x: isinstance(x, tuple))[0]):
    if tuple(leaf.shape) != tuple(want):
      raise CheckpointError(f"{directory}: param {jax.tree_util.keystr(path)} has shape {leaf.shape}; "
                            f"expected {want}")
  if dtype is not None and resolve_dtype(dtype) != saved:
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(resolve_dtype(dtype))), params)
  return cfg, params, Tokenizer.load(directory), meta.get("source", "")
