"""Load a GGUF file (llama.cpp) -> (ModelConfig, params, metadata), dequantized with the `gguf` package.

GGUF lists dimensions innermost first, so a linear weight with ne = [in, out] reads as a numpy [out, in] matrix
(the HF layout, transposed to [in, out] here). llama.cpp's converter permutes the Q and K rows of `llama`
models per head for its interleaved RoPE; they are put back into HF's rotate-half order on load.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from specache_jax.checkpoints import CheckpointError, resolve_dtype, to_jax
from specache_jax.checkpoints.hf import assemble
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
  """A gguf.GGUFReader for `path`, with CheckpointError for a missing or unreadable file."""
  from gguf import GGUFReader
  if not os.path.isfile(path):
    raise CheckpointError(f"{path} does not exist; expected a GGUF model file")
  try:
    return GGUFReader(path)
  except Exception as err:  # the reader raises ValueError / struct errors / IndexError on bad files
    raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt?): {err}") from err


def read_fields(reader) -> dict[str, Any]:
  """All metadata of a reader as Python values (strings, numbers, lists)."""
  return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


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
      raise CheckpointError(f"GGUF metadata {arch}.{key}={value!r} varies per layer; expected one number")
    return value

  n_heads = int(get("attention.head_count", required=True))
  dim = int(get("embedding_length", required=True))
  head_dim = int(get("attention.key_length", dim // n_heads))
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
  vocab = get("vocab_size", len(tokens) if tokens else None, required=True)
  eos = [fields.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
  eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
  bos = fields.get("tokenizer.ggml.bos_token_id")
  return ModelConfig(
      architecture=ARCHITECTURES[arch][0],
      vocab_size=int(vocab),
      dim=dim,
      n_layers=int(get("block_count", required=True)),
      n_heads=n_heads,
      n_kv_heads=int(get("attention.head_count_kv", n_heads)),
      head_dim=head_dim,
      ffn_dim=int(get("feed_forward_length", required=True)),
      norm_eps=_tidy(get("attention.layer_norm_rms_epsilon", 1e-5)),
      rope_theta=_tidy(get("rope.freq_base", 10000.0)),
      rope_scaling=scaling,
      max_position=int(get("context_length", 4096)),
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
  reader = open_reader(path)
  fields = read_fields(reader)
  tensors = {t.name: t for t in reader.tensors}
  if "rope_freqs.weight" in tensors:
    raise CheckpointError(f"{path} stores RoPE frequency factors (rope_freqs.weight, Llama 3.1-style scaling), "
                          "which this GGUF loader does not support; load the HF directory instead")
  cfg = from_gguf_metadata(fields, tuple(tensors), name=os.path.splitext(os.path.basename(path))[0])
  permuted = ARCHITECTURES[fields["general.architecture"]][1]
  q_heads = {"attn_q.weight": cfg.n_heads, "attn_k.weight": cfg.n_kv_heads}
  used = set()

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise CheckpointError(f"{path} is missing tensor {name!r} (expected numpy shape {list(shape)})")
    t = tensors[name]
    found = tuple(int(d) for d in reversed(t.shape))
    if found != tuple(shape):
      raise CheckpointError(f"tensor {name!r} in {path} has shape {list(found)}; expected {list(shape)}")
    try:
      w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    except Exception as err:
      raise CheckpointError(f"tensor {name!r} ({t.tensor_type.name}) in {path} cannot be dequantized: {err}") from err
    suffix = name.split(".", 2)[-1]
    if permuted and suffix in q_heads:
      w = unpermute_qk(w, q_heads[suffix])
    used.add(name)
    return w

  params = assemble(cfg, get, LAYER_TENSORS, TOP_TENSORS)
  unused = sorted(set(tensors) - used)
  if unused:
    raise CheckpointError(f"{path} has tensors this decoder does not use: {unused[:5]} (an unsupported variant)")
  return cfg, to_jax(params, dtype), fields
