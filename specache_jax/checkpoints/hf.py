"""Load an HF transformers directory: config.json + model.safetensors (or a sharded index) -> (ModelConfig, params).

HF `nn.Linear` weights are [out, in]; the params layout (docs/design.md) is [in, out] with the layers stacked on a
leading L axis. Q/K rows already use the rotate-half RoPE layout the decoder expects. Every safetensors header is
checked against its file (headers.py) and every tensor's name, shape and dtype against the config before any tensor
data is read; the data is then read with numpy from its checked byte range.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Mapping

import ml_dtypes
import numpy as np

from specache_jax.checkpoints import CheckpointError, resolve_dtype, to_jax
from specache_jax.checkpoints.headers import safetensors_header
from specache_jax.errors import ConfigError
from specache_jax.model.init import param_shapes
from specache_jax.model_config import ModelConfig, from_hf_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# params leaf -> (HF tensor name pattern with {i} for the layer, transpose [out, in] -> [in, out])
LAYER_TENSORS = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}
TOP_TENSORS = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
# Buffers some older checkpoints store that carry no weights (RoPE frequencies are recomputed from config).
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$|^model\.rotary_emb\.inv_freq$")


def read_json(path: str, what: str) -> dict:
  if not os.path.isfile(path):
    raise CheckpointError(f"{path} does not exist; expected {what}")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise CheckpointError(f"{path} is not valid JSON ({err}); expected {what}") from err


def read_config(path: str) -> ModelConfig:
  """config.json of an HF directory -> ModelConfig (ConfigError for unsupported architectures, CheckpointError
  for a file that is not a model config)."""
  if not os.path.isdir(path):
    raise CheckpointError(f"{path!r} is not a directory; expected an HF checkpoint directory with config.json "
                          f"and {SINGLE_FILE} or {INDEX_FILE}")
  file = os.path.join(path, "config.json")
  cfg = read_json(file, "the HF model config (config.json)")
  if not isinstance(cfg, dict):
    raise CheckpointError(f"{file} holds a {type(cfg).__name__}; expected a JSON object")
  act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
  if act not in ("silu", "swish"):
    raise ConfigError(f"hidden_act={act!r} in {file} is not supported; the MLP is SwiGLU (silu)")
  try:
    return from_hf_config(cfg, name=os.path.basename(os.path.normpath(path)))
  except ConfigError as err:
    raise ConfigError(f"{file}: {err}") from err
  except (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError) as err:
    raise CheckpointError(f"{file} does not describe a model: {type(err).__name__}: {err}") from err


def weight_files(path: str) -> dict[str, str]:
  """tensor name -> safetensors file path, from the index (sharded) or the single file."""
  index = os.path.join(path, INDEX_FILE)
  single = os.path.join(path, SINGLE_FILE)
  if os.path.isfile(index):
    data = read_json(index, "a safetensors index with a 'weight_map'")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f"{index} has no 'weight_map' (tensor name -> shard file)")
    bad = [shard for shard in weight_map.values() if not isinstance(shard, str) or os.path.basename(shard) != shard]
    if bad:
      raise CheckpointError(f"{index} maps tensors to {bad[:3]!r}; expected shard file names in {path}")
    files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
      if not os.path.isfile(shard):
        raise CheckpointError(f"shard {shard} listed in {index} does not exist")
    return files
  if os.path.isfile(single):
    return {name: single for name in safetensors_header(single)}
  raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; expected the model weights in "
                        "safetensors format (save with save_pretrained(..., safe_serialization=True))")


# safetensors dtype -> the numpy dtype of its bytes (little-endian); only float tensors are weights
FLOAT_DTYPES = {"F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"),
                "F64": np.dtype("<f8")}


class TensorReader:
  """Reads tensors by name from safetensors files as numpy arrays. Every file's header is checked
  (`headers.safetensors_header`) when the reader is made, so a tensor's bytes lie inside its file."""

  def __init__(self, files: dict[str, str], root: str = ""):
    self.files = files
    self.root = root
    single = sorted(set(files.values()))
    self.where = single[0] if len(single) == 1 else f"the checkpoint {root}"   # what error messages name
    headers = {file: safetensors_header(file) for file in sorted(set(files.values()))}
    self.infos = {}
    for name, file in files.items():
      if name not in headers[file]:
        raise CheckpointError(f"the checkpoint {root} lists tensor {name!r} in {file}, whose header lacks it")
      self.infos[name] = headers[file][name]

  def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Every expected tensor present with its stored shape and a float dtype, before any data is read."""
    for name, shape in expected.items():
      if name not in self.infos:
        raise CheckpointError(f"{self.where} is missing tensor {name!r} (expected shape {list(shape)})")
      info = self.infos[name]
      if info.shape != tuple(shape):
        raise CheckpointError(f"tensor {name!r} in {self.files[name]} has shape {list(info.shape)}; expected "
                              f"{list(shape)}")
      if info.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r} in {self.files[name]} has dtype={info.dtype}; expected one of "
                              f"{tuple(FLOAT_DTYPES)}")

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor `name`, checked to have `shape` (as stored: HF [out, in] for linear weights)."""
    self.check({name: shape})
    info, file = self.infos[name], self.files[name]
    dtype = FLOAT_DTYPES[info.dtype]
    try:
      array = np.fromfile(file, dtype=dtype, count=info.nbytes // dtype.itemsize, offset=info.begin)
    except OSError as err:
      raise CheckpointError(f"tensor {name!r} in {file} cannot be read: {err}") from err
    if array.nbytes != info.nbytes:   # the file shrank since its header was checked
      raise CheckpointError(f"{file} is truncated or corrupt: tensor {name!r} has {array.nbytes} of its "
                            f"{info.nbytes} bytes")
    return array.reshape(info.shape)


def _stored_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
  return tuple(reversed(shape)) if transpose else tuple(shape)


def _plan(cfg: ModelConfig, layer_names: dict, top_names: dict) -> list[tuple[str, list[str], tuple, bool]]:
  """-> [(params leaf, stored tensor names (one per layer for a layer leaf), stored shape, transpose)]."""
  shapes = param_shapes(cfg)
  plan = []
  for leaf, shape in shapes["layers"].items():
    pattern, transpose = layer_names[leaf]
    names = [pattern.format(i=i) for i in range(cfg.n_layers)]
    plan.append((leaf, names, _stored_shape(shape[1:], transpose), transpose))
  for leaf in ("embed", "final_norm", "lm_head"):
    if leaf in shapes:
      name, transpose = top_names[leaf]
      plan.append((leaf, [name], _stored_shape(shapes[leaf], transpose), transpose))
  return plan


def check_layer_count(cfg: ModelConfig, n_tensors: int, where: str) -> None:
  """A config claiming more layers than the checkpoint holds tensors for is refused before any name is listed."""
  needed = cfg.n_layers * len(param_shapes(cfg)["layers"])
  if needed > n_tensors:
    raise CheckpointError(f"{where}: the config's n_layers={cfg.n_layers} needs {needed} layer tensors; the "
                          f"checkpoint holds {n_tensors} tensors in all")


def expected_tensors(cfg: ModelConfig, layer_names: dict, top_names: dict) -> dict[str, tuple[int, ...]]:
  """Stored tensor name -> stored shape, for every tensor `cfg` needs."""
  return {name: stored for _, names, stored, _ in _plan(cfg, layer_names, top_names) for name in names}


def assemble(cfg: ModelConfig, get: Callable[[str, tuple[int, ...]], np.ndarray], layer_names: dict,
             top_names: dict) -> dict:
  """Build the params dict from a tensor getter. `layer_names`/`top_names` map each leaf to (name, transpose);
  `get(name, stored_shape)` returns the checked tensor. Shapes come from `param_shapes(cfg)`."""
  params = {"layers": {}}
  for leaf, names, stored, transpose in _plan(cfg, layer_names, top_names):
    ws = [get(name, stored) for name in names]
    ws = [w.T if transpose else w for w in ws]
    if leaf in top_names:
      params[leaf] = ws[0]
    else:
      params["layers"][leaf] = np.stack(ws)
  return params


def load_hf(path: str, dtype=np.float32) -> tuple[ModelConfig, dict]:
  """An HF directory -> (ModelConfig, params as jax arrays of `dtype` (float32 | bfloat16 | float16))."""
  resolve_dtype(dtype)
  cfg = read_config(path)
  reader = TensorReader(weight_files(path), path)
  check_layer_count(cfg, len(reader.infos), reader.where)
  expected = expected_tensors(cfg, LAYER_TENSORS, TOP_TENSORS)
  reader.check(expected)   # names, shapes and dtypes of everything, before any tensor data is read
  unused = sorted(n for n in reader.files if n not in expected and not IGNORED.match(n)
                  and not (cfg.tie_embeddings and n == "lm_head.weight"))
  if unused:
    shown = ", ".join(unused[:5]) + (f", ... ({len(unused)} in all)" if len(unused) > 5 else "")
    raise CheckpointError(f"{path} has tensors this decoder does not use: {shown} (an unsupported variant, "
                          "e.g. an o_proj or MLP bias); refusing to drop weights silently")
  params = assemble(cfg, reader.get, LAYER_TENSORS, TOP_TENSORS)
  return cfg, to_jax(params, dtype)
