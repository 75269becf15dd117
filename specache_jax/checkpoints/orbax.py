"""Converted params on disk with orbax-checkpoint, plus the ModelConfig (and tokenizer) as files alongside.

A model directory written here holds `params/` (an orbax StandardCheckpointer tree), the tokenizer files when
there is a tokenizer, and `specache_model.json` (format, ModelConfig, dtype, source) — written last, so its
presence marks a complete save. `restore` checks the marker's config, the stored arrays' shapes and dtypes (orbax's
metadata, read without the data) and the total size against the machine's memory before any array is allocated.
"""
from __future__ import annotations

import dataclasses
import json
import math
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
  if not isinstance(d, dict) or not isinstance(d.get("rope_scaling", {}), dict):
    raise CheckpointError(f"the saved model config {d!r:.200} is not an object with a rope_scaling object")
  d = dict(d)
  try:
    d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
    d["eos_token_ids"] = tuple(int(e) for e in d.get("eos_token_ids", ()))
    return ModelConfig(**d)
  except (TypeError, ValueError, OverflowError) as err:   # ConfigError (a ValueError) included
    raise CheckpointError(f"the saved model config is not a valid ModelConfig: {err}") from err


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
  """The marker file's contents, checked: "config" as a ModelConfig, "dtype" as a list of (one) numpy dtype."""
  marker = os.path.join(directory, MARKER)
  if not os.path.isfile(marker):
    raise CheckpointError(f"{directory} is not a complete specache_jax model directory: {MARKER} is missing")
  try:
    with open(marker, encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise CheckpointError(f"{marker} is not valid JSON: {err}") from err
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    found = meta.get("format") if isinstance(meta, dict) else meta
    raise CheckpointError(f"{marker} has format={found!r:.200}; expected {FORMAT!r}")
  dtypes = meta.get("dtype", [])
  if not isinstance(dtypes, list) or len(dtypes) > 1 or not all(isinstance(d, str) for d in dtypes):
    raise CheckpointError(f"{marker} has dtype={dtypes!r:.200}; expected a list of one dtype name")
  try:
    meta["config"] = config_from_dict(meta.get("config"))
    meta["dtype"] = [resolve_dtype(d) for d in dtypes]
  except CheckpointError as err:
    raise CheckpointError(f"{marker}: {err}") from err
  return meta


def _flat(tree, prefix: str = "") -> dict[str, Any]:
  """A nested dict -> {"layers.wq": leaf, ...}."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}" if prefix else key).items()}


def physical_memory() -> int:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_stored(directory: str, cfg: ModelConfig, saved: np.dtype) -> None:
  """The stored arrays (orbax metadata, no data read) are exactly param_shapes(cfg) in dtype `saved`, and fit in
  memory: CheckpointError naming the param and the values otherwise."""
  import orbax.checkpoint as ocp
  want = _flat(param_shapes(cfg))
  total = sum(math.prod(shape) for shape in want.values()) * saved.itemsize
  if total > physical_memory():
    raise CheckpointError(f"{directory}: the config ({cfg.n_layers=}, {cfg.dim=}, {cfg.vocab_size=}, "
                          f"{cfg.ffn_dim=}) needs {total} bytes of params, more than this machine's "
                          f"{physical_memory()} bytes of memory")
  checkpointer = ocp.StandardCheckpointer()
  try:
    meta = checkpointer.metadata(os.path.join(directory, "params"))
  except Exception as err:  # orbax / tensorstore raise many types for missing or damaged files
    raise CheckpointError(f"{directory}/params has no readable metadata (damaged?): {type(err).__name__}: "
                          f"{err}") from err
  finally:
    checkpointer.close()
  tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
  if not hasattr(tree, "keys"):
    raise CheckpointError(f"{directory}/params has no array metadata (orbax read {type(tree).__name__}; damaged "
                          "or missing _METADATA / manifest?)")
  found = _flat(dict(tree))
  if set(found) != set(want):
    raise CheckpointError(f"{directory}/params holds {sorted(found)[:20]}; the config needs {sorted(want)}")
  for key, shape in want.items():
    stored = (tuple(getattr(found[key], "shape", ()) or ()), getattr(found[key], "dtype", None))
    if stored[0] != tuple(shape) or stored[1] is None or np.dtype(stored[1]) != saved:
      raise CheckpointError(f"{directory}/params: param {key!r} is stored with shape {stored[0]} and dtype "
                            f"{stored[1]}; the config needs shape {tuple(shape)} and dtype {saved}")


def restore(directory: str, dtype=None) -> tuple[ModelConfig, dict, Any, str]:
  """-> (ModelConfig, params, Tokenizer | None, source). dtype None keeps the saved dtype, else casts."""
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  directory = os.path.abspath(directory)
  meta = read_meta(directory)
  cfg = meta["config"]
  saved = meta["dtype"][0] if meta["dtype"] else np.dtype(np.float32)
  check_stored(directory, cfg, saved)
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
  try:
    tokenizer = Tokenizer.load(directory)
  except Exception as err:  # noqa: BLE001 (json, the tokenizers library and the settings raise many types)
    raise CheckpointError(f"{directory}: the saved tokenizer (tokenizer.json, tokenizer_settings.json) cannot be "
                          f"loaded: {type(err).__name__}: {err}") from err
  return cfg, params, tokenizer, meta.get("source", "")
