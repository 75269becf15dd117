"""Load a GGUF file (llama.cpp) -> (ModelConfig, params, metadata), dequantized with the `gguf` package.

GGUF lists dimensions innermost first, so a linear weight with ne = [in, out] reads as a numpy [out, in] matrix
(the HF layout, transposed to [in, out] here). llama.cpp's converter permutes the Q and K rows of `llama`
models per head for its interleaved RoPE; they are put back into HF's rotate-half order on load. The header is
checked against the file's size (headers.py) before the `gguf` reader sees it, and every tensor's name, shape and
type against the config before any tensor is dequantized.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from specache_jax.checkpoints import CheckpointError, resolve_dtype, to_jax
from specache_jax.checkpoints.headers import TensorInfo, gguf_header
from specache_jax.checkpoints.hf import assemble, check_layer_count, expected_tensors
from specache_jax.errors import ConfigError
from specache_jax.model_config import ModelConfig, RopeScaling

# GGUF architecture -> (ModelConfig.architecture, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False)}

LAYER_TENSORS = {
    "attn_norm": ("blk.{i}.attn_norm.weight", False),
    "wq": ("blk.{i}.attn_q.weight", True),
    "wk": ("blk.{i}.attn_k.weight", True),
    "wv": ("blk.{i}.attn_v.weight", True),
    "bq": ("blk.{i}.attn_q.bias", False),
    "bk": ("blk.{i}.attn_k.bias", False),
    "bv": ("blk.{i}.attn_v.bias", False),
    "wo": ("blk.{i}.attn_output.weight", True),
    "mlp_norm": ("blk.{i}.ffn_norm.weight", False),
    "w_gate": ("blk.{i}.ffn_gate.weight", True),
    "w_up": ("blk.{i}.ffn_up.weight", True),
    "w_down": ("blk.{i}.ffn_down.weight", True),
}
TOP_TENSORS = {
    "embed": ("token_embd.weight", False),
    "final_norm": ("output_norm.weight", False),
    "lm_head": ("output.weight", True),
}


def open_reader(path: str):
  """A gguf.GGUFReader for `path`, with CheckpointError for a missing, truncated or corrupt file."""
  return open_checked(path)[0]


def open_checked(path: str):
  """-> (gguf.GGUFReader, headers.GGUFHeader). The header is checked first (`headers.gguf_header`): the reader
  itself loops over counts a corrupt header can inflate to 2**64 and makes views past the end of the file."""
  from gguf import GGUFReader
  if not os.path.isfile(path):
    raise CheckpointError(f"{path} does not exist; expected a GGUF model file")
  header = gguf_header(path)
  try:
    reader = GGUFReader(path)
  except Exception as err:  # the reader raises ValueError / struct errors / IndexError on bad files
    raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt?): {err}") from err
  for t in reader.tensors:   # the reader and the checked header must agree on where every tensor lies
    info = header.tensors.get(t.name)
    if info is None or info.begin != t.data_offset or info.nbytes != t.data.nbytes:
      raise CheckpointError(f"{path}: the gguf reader places tensor {t.name!r} at byte {t.data_offset} "
                            f"({t.data.nbytes} bytes); its checked header says {info}")
  return reader, header


def read_fields(reader) -> dict[str, Any]:
  """All metadata of a reader as Python values (strings, numbers, lists)."""
  return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


# GGML types whose values are integers, not weights (the rest are floats or quantized floats)
INTEGER_TYPES = ("I8", "I16", "I32", "I64")


def check_tensors(path: str, tensors: dict[str, TensorInfo], expected: Mapping[str, tuple[int, ...]]) -> None:
  """Every expected tensor present with its numpy shape and a float or quantized type, and nothing else."""
  for name, shape in expected.items():
    if name not in tensors:
      raise CheckpointError(f"{path} is missing tensor {name!r} (expected numpy shape {list(shape)})")
    info = tensors[name]
    if info.shape != tuple(shape):
      raise CheckpointError(f"tensor {name!r} in {path} has shape {list(info.shape)}; expected {list(shape)}")
    if info.dtype in INTEGER_TYPES:
      raise CheckpointError(f"tensor {name!r} in {path} has type {info.dtype}; expected a float or quantized type")
  unused = sorted(set(tensors) - set(expected))
  if unused:
    raise CheckpointError(f"{path} has tensors this decoder does not use: {unused[:5]} (an unsupported variant)")


def _tidy(value: float) -> float:
  """float32 metadata (e.g. eps 9.99999975e-06) -> the decimal it was written from (1e-05)."""
  return float(f"{float(value):.7g}")


def from_gguf_metadata(fields: Mapping[str, Any], tensor_names: Sequence[str] = (), name: str = "") -> ModelConfig:
  """GGUF metadata (`read_fields`) -> ModelConfig. `tensor_names` decides tied embeddings (no output.weight)."""
  arch = fields.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ConfigError(f"GGUF general.architecture={arch!r} is not supported; expected one of {tuple(ARCHITECTURES)}")

  def get(key: str, default: Any = None, required: bool = False):
    value = fields.get(f"{arch}.{key}", default)
    if required and value is None:
      raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
    if isinstance(value, (list, tuple)):
      raise CheckpointError(f"GGUF metadata {arch}.{key}={value!r:.200} varies per layer; expected one number")
    if value is not None and not isinstance(value, (int, float, str)):
      raise CheckpointError(f"GGUF metadata {arch}.{key}={value!r:.200} has type {type(value).__name__}")
    return value

  def count(key: str, default: Any = None, required: bool = False) -> int:
    value = get(key, default, required)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise CheckpointError(f"GGUF metadata {arch}.{key}={value!r:.200} must be a positive integer")
    return value

  n_heads = count("attention.head_count", required=True)
  dim = count("embedding_length", required=True)
  head_dim = count("attention.key_length", dim // n_heads)
  rope_dims = get("rope.dimension_count")
  if rope_dims is not None and int(rope_dims) != head_dim:
    raise ConfigError(f"{arch}.rope.dimension_count={rope_dims} differs from head_dim={head_dim}: partial "
                      "rotary embeddings are not supported")
  scaling_type = get("rope.scaling.type", "none")
  if scaling_type in ("none", None) and get("rope.scale_linear") is None:
    scaling = RopeScaling()
  elif scaling_type == "linear" or get("rope.scale_linear") is not None:
    scaling = RopeScaling("linear", factor=_tidy(get("rope.scaling.factor", get("rope.scale_linear", 1.0))))
  else:
    raise ConfigError(f"{arch}.rope.scaling.type={scaling_type!r} is not supported; expected none or linear")
  tokens = fields.get("tokenizer.ggml.tokens")
  vocab = count("vocab_size", len(tokens) if tokens else None, required=True)
  eos = [fields.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
  eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
  bos = fields.get("tokenizer.ggml.bos_token_id")
  return ModelConfig(
      architecture=ARCHITECTURES[arch][0],
      vocab_size=vocab,
      dim=dim,
      n_layers=count("block_count", required=True),
      n_heads=n_heads,
      n_kv_heads=count("attention.head_count_kv", n_heads),
      head_dim=head_dim,
      ffn_dim=count("feed_forward_length", required=True),
      norm_eps=_tidy(get("attention.layer_norm_rms_epsilon", 1e-5)),
      rope_theta=_tidy(get("rope.freq_base", 10000.0)),
      rope_scaling=scaling,
      max_position=count("context_length", 4096),
      tie_embeddings="output.weight" not in tensor_names,
      qkv_bias="blk.0.attn_q.bias" in tensor_names,
      bos_token_id=None if bos is None else int(bos),
      eos_token_ids=eos_ids,
      name=name or str(fields.get("general.name", "")))


def unpermute_qk(w_out_in: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's per-head Q/K row permutation: w [out, in] -> [out, in] in rotate-half order."""
  out, inp = w_out_in.shape
  if out % (2 * heads):
    raise CheckpointError(f"Q/K rows {out=} must split into {heads=} heads of even size")
  return w_out_in.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def permute_qk(w_out_in: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's converter permutation (the inverse of `unpermute_qk`); used to write test GGUF files."""
  out, inp = w_out_in.shape
  return w_out_in.reshape(heads, 2, out // heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path: str, dtype=np.float32) -> tuple[ModelConfig, dict, dict[str, Any]]:
  """A .gguf file -> (ModelConfig, params as jax arrays of `dtype`, all metadata fields (tokenizer included))."""
  from gguf import quants
  resolve_dtype(dtype)
  reader, header = open_checked(path)
  fields = read_fields(reader)
  tensors = {t.name: t for t in reader.tensors}
  if "rope_freqs.weight" in tensors:
    raise CheckpointError(f"{path} stores RoPE frequency factors (rope_freqs.weight, Llama 3.1-style scaling), "
                          "which this GGUF loader does not support; load the HF directory instead")
  try:
    cfg = from_gguf_metadata(fields, tuple(tensors), name=os.path.splitext(os.path.basename(path))[0])
  except (ConfigError, CheckpointError) as err:
    raise type(err)(f"{path}: {err}") from err
  except (TypeError, ValueError, OverflowError, ZeroDivisionError) as err:   # a value of the wrong kind
    raise CheckpointError(f"{path}: the GGUF metadata does not describe a model: {type(err).__name__}: "
                          f"{err}") from err
  check_layer_count(cfg, len(header.tensors), path)
  check_tensors(path, header.tensors, expected_tensors(cfg, LAYER_TENSORS, TOP_TENSORS))
  permuted = ARCHITECTURES[fields["general.architecture"]][1]
  q_heads = {"attn_q.weight": cfg.n_heads, "attn_k.weight": cfg.n_kv_heads}

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    t = tensors[name]
    try:
      w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    except Exception as err:
      raise CheckpointError(f"tensor {name!r} ({t.tensor_type.name}) in {path} cannot be dequantized: {err}") from err
    suffix = name.split(".", 2)[-1]
    if permuted and suffix in q_heads:
      w = unpermute_qk(w, q_heads[suffix])
    return w

  return cfg, to_jax(assemble(cfg, get, LAYER_TENSORS, TOP_TENSORS), dtype), fields
