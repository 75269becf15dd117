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
