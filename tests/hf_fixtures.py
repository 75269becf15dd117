"""Tiny random HF checkpoints written with transformers from a config (no hub): the loader and parity fixtures.

Each builder returns the directory it wrote (safetensors via save_pretrained). Weights are redrawn with a seeded
torch generator at a scale where logits vary visibly (transformers' own init makes them nearly uniform), norms
around 1, biases non-zero, so a wrong transpose, permutation or missing bias shows in the logits.
"""
from __future__ import annotations

import json
import os

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
             eos_token_id=2)


def _configs():
  from transformers import LlamaConfig, MistralConfig, Qwen2Config
  return {
      "llama3": lambda: LlamaConfig(**SMALL, rope_parameters={
          "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
      "mistral": lambda: MistralConfig(**SMALL, sliding_window=None,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
      "qwen2": lambda: Qwen2Config(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
      "tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
      "mha": lambda: LlamaConfig(**{**SMALL, "num_key_value_heads": 4},
                                 rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
  }


FIXTURES = ("llama3", "mistral", "qwen2", "tied", "mha")


def build_model(kind: str, seed: int = 0):
  """A torch float32 model (eager attention) with seeded random weights."""
  import torch
  from transformers import AutoModelForCausalLM
  if kind not in FIXTURES:
    raise ValueError(f"kind={kind!r} must be one of {FIXTURES}")
  config = _configs()[kind]()
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.3 * noise)
      elif "embed" in name:
        p.copy_(1.0 * noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5)
  model.eval()
  return model


def write_checkpoint(kind: str, directory: str, seed: int = 0, max_shard_size: str | None = None) -> str:
  """Save fixture `kind` under `directory` (sharded into an index when max_shard_size is given)."""
  model = build_model(kind, seed)
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(directory, **kwargs)
  return directory


def legacy_config(directory: str) -> None:
  """Rewrite config.json in the transformers 4.x layout: top-level rope_theta + rope_scaling."""
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  params = cfg.pop("rope_parameters", None) or {}
  cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
  rope_type = params.pop("rope_type", "default")
  cfg["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **params}
  cfg["torch_dtype"] = cfg.pop("dtype", "float32")
  with open(path, "w") as f:
    json.dump(cfg, f)


_GGUF_NAMES = {  # HF tensor name suffix -> GGUF name (llama.cpp's naming)
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(model, path: str, qtype: str = "F32", arch: str = "llama") -> str:
  """Write a torch fixture model as a GGUF file the way llama.cpp's converter lays it out: numpy [out, in]
  matrices, Q/K rows permuted per head for `llama`, no output.weight when tied. Matrices are stored as
  `qtype` (F32 | F16 | Q8_0), norms and biases as F32. No tokenizer metadata."""
  import gguf
  from specache_jax.checkpoints.gguf import permute_qk
  cfg = model.config
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
  w.add_eos_token_id(2)
  w.add_bos_token_id(1)
  qt = getattr(gguf.GGMLQuantizationType, qtype)
  for name, tensor in model.state_dict().items():
    x = tensor.detach().float().numpy()
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    if name.startswith("model.layers."):
      _, _, i, suffix = name.split(".", 3)
      gname = f"blk.{i}.{_GGUF_NAMES[suffix]}"
      if arch == "llama" and suffix == "self_attn.q_proj.weight":
        x = permute_qk(x, cfg.num_attention_heads)
      if arch == "llama" and suffix == "self_attn.k_proj.weight":
        x = permute_qk(x, cfg.num_key_value_heads)
    else:
      gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}[name]
    if x.ndim == 2 and qtype != "F32":
      w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
    else:
      w.add_tensor(gname, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
