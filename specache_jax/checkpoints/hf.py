"""Load an HF transformers directory: config.json + model.safetensors (or a sharded index) -> (ModelConfig, params).

HF `nn.Linear` weights are [out, in]; the params layout (DESIGN.md) is [in, out] with the layers stacked on a
leading L axis. Q/K rows already use the rotate-half RoPE layout the decoder expects.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable

import numpy as np

from specache_jax.checkpoints import CheckpointError, resolve_dtype, to_jax
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
  """config.json of an HF directory -> ModelConfig (ConfigError for unsupported architectures)."""
  if not os.path.isdir(path):
    raise CheckpointError(f"{path!r} is not a directory; expected an HF checkpoint directory with config.json "
                          f"and {SINGLE_FILE} or {INDEX_FILE}")
  cfg = read_json(os.path.join(path, "config.json"), "the HF model config (config.json)")
  act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
  if act not in ("silu", "swish"):
    raise ConfigError(f"hidden_act={act!r} in {path}/config.json is not supported; the MLP is SwiGLU (silu)")
  return from_hf_config(cfg, name=os.path.basename(os.path.normpath(path)))


def weight_files(path: str) -> dict[str, str]:
  """tensor name -> safetensors file path, from the index (sharded) or the single file."""
  index = os.path.join(path, INDEX_FILE)
  single = os.path.join(path, SINGLE_FILE)
  if os.path.isfile(index):
    data = read_json(index, "a safetensors index with a 'weight_map'")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f"{index} has no 'weight_map' (tensor name -> shard file)")
    files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
      if not os.path.isfile(shard):
        raise CheckpointError(f"shard {shard} listed in {index} does not exist")
    return files
  if os.path.isfile(single):
    return {name: single for name in _open_names(single)}
  raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; expected the model weights in "
                        "safetensors format (save with save_pretrained(..., safe_serialization=True))")


def _open_names(file: str) -> list[str]:
  from safetensors import safe_open
  try:
    with safe_open(file, framework="np") as f:
      return list(f.keys())
  except Exception as err:  # safetensors raises SafetensorError (an Exception) for bad headers/truncation
    raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {err}") from err


class TensorReader:
  """Reads tensors by name from safetensors files (one open handle per file), as numpy arrays."""

  def __init__(self, files: dict[str, str], root: str = ""):
    self.files = files
    self.root = root
    self._handles: dict[str, object] = {}
    self.used: set[str] = set()

  def _handle(self, file: str):
    from safetensors import safe_open
    if file not in self._handles:
      try:
        self._handles[file] = safe_open(file, framework="np")
      except Exception as err:
        raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {err}") from err
    return self._handles[file]

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor `name`, checked to have `shape` (as stored: HF [out, in] for linear weights)."""
    if name not in self.files:
      raise CheckpointError(f"the checkpoint {self.root} is missing tensor {name!r} (expected shape "
                            f"{list(shape)})")
    file = self.files[name]
    handle = self._handle(file)
    try:
      view = handle.get_slice(name)
      found, dtype = tuple(view.get_shape()), view.get_dtype()
    except Exception as err:
      raise CheckpointError(f"tensor {name!r} listed for {file} cannot be read: {err}") from err
    if found != tuple(shape):
      raise CheckpointError(f"tensor {name!r} in {file} has shape {list(found)}; expected {list(shape)}")
    try:
      if dtype == "BF16":  # numpy has no bfloat16: read through the flax framework (ml_dtypes)
        from safetensors import safe_open
        with safe_open(file, framework="flax") as f:
          array = np.asarray(f.get_tensor(name))
      else:
        array = handle.get_tensor(name)
    except Exception as err:
      raise CheckpointError(f"tensor {name!r} in {file} cannot be read (truncated or corrupt?): {err}") from err
    self.used.add(name)
    return array


def _stored_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
  return tuple(reversed(shape)) if transpose else tuple(shape)


def assemble(cfg: ModelConfig, get: Callable[[str, tuple[int, ...]], np.ndarray], layer_names: dict,
             top_names: dict) -> dict:
  """Build the params dict from a tensor getter. `layer_names`/`top_names` map each leaf to (name, transpose);
  `get(name, stored_shape)` returns the checked tensor. Shapes come from `param_shapes(cfg)`."""
  shapes = param_shapes(cfg)
  layers = {}
  for leaf, shape in shapes["layers"].items():
    pattern, transpose = layer_names[leaf]
    stored = _stored_shape(shape[1:], transpose)
    per_layer = [get(pattern.format(i=i), stored) for i in range(cfg.n_layers)]
    layers[leaf] = np.stack([w.T if transpose else w for w in per_layer])
  params = {"layers": layers}
  for leaf in ("embed", "final_norm", "lm_head"):
    if leaf in shapes:
      name, transpose = top_names[leaf]
      w = get(name, _stored_shape(shapes[leaf], transpose))
      params[leaf] = w.T if transpose else w
  return params


def load_hf(path: str, dtype=np.float32) -> tuple[ModelConfig, dict]:
  """An HF directory -> (ModelConfig, params as jax arrays of `dtype` (float32 | bfloat16 | float16))."""
  resolve_dtype(dtype)
  cfg = read_config(path)
  reader = TensorReader(weight_files(path), path)
  params = assemble(cfg, reader.get, LAYER_TENSORS, TOP_TENSORS)
  unused = sorted(n for n in reader.files if n not in reader.used and not IGNORED.match(n)
                  and not (cfg.tie_embeddings and n == "lm_head.weight"))
  if unused:
    shown = ", ".join(unused[:5]) + (f", ... ({len(unused)} in all)" if len(unused) > 5 else "")
    raise CheckpointError(f"{path} has tensors this decoder does not use: {shown} (an unsupported variant, "
                          "e.g. an o_proj or MLP bias); refusing to drop weights silently")
  return cfg, to_jax(params, dtype)
