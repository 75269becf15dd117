"""Tiny checkpoints written without torch (safetensors, GGUF, orbax) and the guards of the hostile-file tests.

`bounded()` runs a load under an address-space limit a little above what the process already maps and a wall-clock
alarm: an allocation sized by a corrupt header fails (MemoryError) instead of succeeding lazily, and a loop over an
inflated count raises `Hang` (a BaseException, so no loader's `except Exception` can turn it into a clean error).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal

import numpy as np
from gguf.constants import GGUFValueType

from specache_jax.checkpoints import gguf as gguf_io, hf
from specache_jax.model_config import ModelConfig
from specache_jax.model.init import param_shapes

CFG = ModelConfig("llama", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                  max_position=128, bos_token_id=1, eos_token_ids=(2,), name="tiny")


def random_params(cfg: ModelConfig = CFG, seed: int = 0) -> dict:
  """float32 numpy params of `cfg` (norms around 1, weights ~0.3)."""
  rng = np.random.default_rng(seed)

  def draw(path, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return 1.0 + 0.1 * x if "norm" in path else 0.3 * x
  return {"layers": {k: draw(k, s) for k, s in param_shapes(cfg)["layers"].items()},
          **{k: draw(k, s) for k, s in param_shapes(cfg).items() if k != "layers"}}


def hf_config(cfg: ModelConfig = CFG) -> dict:
  return {"model_type": cfg.architecture, "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "head_dim": cfg.head_dim,
          "num_key_value_heads": cfg.n_kv_heads, "max_position_embeddings": cfg.max_position,
          "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
          "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}


def _stored(params: dict, layer_names: dict, top_names: dict, n_layers: int) -> dict[str, np.ndarray]:
  """params -> {checkpoint tensor name: stored array} (linear weights back to [out, in])."""
  out = {}
  for leaf, w in params["layers"].items():
    pattern, transpose = layer_names[leaf]
    for i in range(n_layers):
      out[pattern.format(i=i)] = np.ascontiguousarray(w[i].T if transpose else w[i])
  for leaf, (name, transpose) in top_names.items():
    if leaf in params:
      out[name] = np.ascontiguousarray(params[leaf].T if transpose else params[leaf])
  return out


def tiny_tokenizer(cfg: ModelConfig = CFG):
  """A byte-less BPE tokenizer over `cfg.vocab_size` made-up tokens (what an orbax model directory saves)."""
  from tokenizers import Tokenizer as Backend, models
  from specache_jax.tokenizer import Tokenizer
  vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
  return Tokenizer(Backend(models.BPE(vocab=vocab, merges=[])), bos_token_id=cfg.bos_token_id,
                   eos_token_ids=cfg.eos_token_ids)


def write_hf(directory: str, params: dict, cfg: ModelConfig = CFG) -> str:
  """config.json + model.safetensors (float32) in `directory`."""
  from safetensors.numpy import save_file
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config(cfg), f)
  save_file(_stored(params, hf.LAYER_TENSORS, hf.TOP_TENSORS, cfg.n_layers),
            os.path.join(directory, "model.safetensors"))
  return directory


def write_gguf(path: str, params: dict, cfg: ModelConfig = CFG) -> str:
  """A llama GGUF like llama.cpp writes it: Q/K rows permuted, matrices Q8_0, the embedding F16, norms F32."""
  import gguf
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(cfg.n_layers)
  w.add_context_length(cfg.max_position)
  w.add_embedding_length(cfg.dim)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_bos_token_id(cfg.bos_token_id)
  w.add_eos_token_id(cfg.eos_token_ids[0])
  w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
  q8 = gguf.GGMLQuantizationType.Q8_0
  for name, x in _stored(params, gguf_io.LAYER_TENSORS, gguf_io.TOP_TENSORS, cfg.n_layers).items():
    if name.endswith("attn_q.weight"):
      x = gguf_io.permute_qk(x, cfg.n_heads)
    elif name.endswith("attn_k.weight"):
      x = gguf_io.permute_qk(x, cfg.n_kv_heads)
    if name == "token_embd.weight":
      w.add_tensor(name, x.astype(np.float16))
    elif x.ndim == 2:
      w.add_tensor(name, gguf.quants.quantize(x, q8), raw_dtype=q8)
    else:
      w.add_tensor(name, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def gguf_fields(path: str) -> tuple[list[tuple[str, int, int]], int]:
  """The binary header fields of a pristine GGUF (found with the `gguf` reader, independent of the loader's own
  parser): [(what, byte offset, width 4 | 8)] for counts, lengths, value types, dims, tensor types and offsets,
  and the byte where tensor data starts."""
  from gguf import GGUFReader
  r = GGUFReader(path)
  base = r.data.ctypes.data

  def at(part, j=0):
    return int(part.ctypes.data - base) + j * part.itemsize

  out = []
  for key, field in r.fields.items():
    if key.startswith("GGUF."):
      out.append((key, at(field.parts[0]), field.parts[0].itemsize))
      continue
    out += [(f"{key} length", at(field.parts[0]), 8), (f"{key} type", at(field.parts[2]), 4)]
    if len(field.parts) > 4 and field.types[0] == GGUFValueType.ARRAY:
      out += [(f"{key} item type", at(field.parts[3]), 4), (f"{key} count", at(field.parts[4]), 8)]
    elif field.types[0] == GGUFValueType.STRING:
      out.append((f"{key} value length", at(field.parts[3]), 8))
  for t in r.tensors:
    name_len, _, n_dims, dims, ggml_type, offset = t.field.parts
    out += [(f"{t.name} name length", at(name_len), 8), (f"{t.name} n_dims", at(n_dims), 4),
            (f"{t.name} type", at(ggml_type), 4), (f"{t.name} offset", at(offset), 8)]
    out += [(f"{t.name} dim {j}", at(dims, j), 8) for j in range(len(dims))]
  return out, int(r.data_offset)


class Hang(BaseException):
  """A load that ran past its time limit (a BaseException: `except Exception` in a loader cannot swallow it)."""


def _vm_size() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmSize:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def bounded(seconds: float = 10.0, headroom: int = 1 << 30):
  """Run the body with at most `headroom` more bytes of address space and `seconds` of wall-clock time."""
  soft, hard = resource.getrlimit(resource.RLIMIT_AS)
  limit = _vm_size() + headroom
  if hard != resource.RLIM_INFINITY:
    limit = min(limit, hard)

  def alarm(signum, frame):
    raise Hang(f"the load ran past {seconds} s")

  previous = signal.signal(signal.SIGALRM, alarm)
  resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
