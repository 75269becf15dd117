"""ModelConfig: the architecture of a LLaMA-family decoder, read from an HF config.json or GGUF metadata.

Supported: Llama 2, Llama 3 / 3.1 (``llama3`` RoPE scaling), Mistral (full attention, no sliding window),
Qwen2 (q/k/v bias), SmolLM2. Anything else fails with a clear error.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specache_jax.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. ``rope_type``: default | linear | llama3 (the fields each uses are named)."""
  rope_type: str = "default"
  factor: float = 1.0                 # linear, llama3
  low_freq_factor: float = 1.0        # llama3
  high_freq_factor: float = 4.0       # llama3
  original_max_position: int = 8192   # llama3

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    if self.rope_type not in ROPE_TYPES:
      raise ConfigError(f"rope_type={self.rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    if self.factor <= 0:
      raise ConfigError(f"rope scaling factor={self.factor} must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hashable (usable as a jit static argument). Axis letters: V vocab, D model dim, N query heads,
  K KV heads, H head dim, F MLP hidden, L layers."""
  architecture: str          # llama | mistral | qwen2
  vocab_size: int            # V
  dim: int                   # D
  n_layers: int              # L
  n_heads: int               # N
  n_kv_heads: int            # K
  head_dim: int              # H
  ffn_dim: int               # F
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  max_position: int = 4096   # the model's context length
  tie_embeddings: bool = False
  qkv_bias: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  name: str = ""

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    """Every rule on the config alone (run at construction, and again by `validation.check_model_config` for a
    config built some other way: object.__setattr__, a pickled copy)."""
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ConfigError(f"architecture={self.architecture!r} is not supported; expected one of "
                        f"{SUPPORTED_ARCHITECTURES} (LLaMA-family decoders)")
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                  "max_position"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{field}={value!r} must be a positive integer")
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
    if not self.norm_eps > 0:
      raise ConfigError(f"norm_eps={self.norm_eps} must be > 0")
    if not self.rope_theta > 0:
      raise ConfigError(f"rope_theta={self.rope_theta} must be > 0")
    self.rope_scaling.validate()
    for name, ids in (("eos_token_ids", self.eos_token_ids),
                      ("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,))):
      bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
      if bad:
        raise ConfigError(f"{name}={bad} lie outside the vocabulary [0, vocab_size={self.vocab_size})")

  @property
  def q_per_kv(self) -> int:
    """G: query heads per KV head."""
    return self.n_heads // self.n_kv_heads


def _first(d: Mapping[str, Any], *keys, default=None):
  for k in keys:
    if k in d and d[k] is not None:
      return d[k]
  return default


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling]:
  """transformers 4.x keeps ``rope_theta`` + ``rope_scaling`` at the top level; 5.x nests both in
  ``rope_parameters``."""
  params = cfg.get("rope_parameters") or {}
  scaling = cfg.get("rope_scaling") or {}
  merged = {**scaling, **params}
  theta = float(_first(merged, "rope_theta", default=None) or _first(cfg, "rope_theta", default=10000.0))
  rope_type = _first(merged, "rope_type", "type", default="default")
  if rope_type == "default" or not merged:
    return theta, RopeScaling()
  if rope_type not in ROPE_TYPES:
    raise ConfigError(f"rope_type={rope_type!r} in config.json is not supported; expected one of {ROPE_TYPES}")
  return theta, RopeScaling(
      rope_type=rope_type,
      factor=float(merged.get("factor", 1.0)),
      low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
      high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
      original_max_position=int(merged.get("original_max_position_embeddings", 8192)))


_HF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def from_hf_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
  """Build a ModelConfig from the dict of an HF ``config.json``."""
  model_type = cfg.get("model_type")
  if model_type not in _HF_ARCH:
    archs = cfg.get("architectures")
    raise ConfigError(f"model_type={model_type!r} (architectures={archs}) is not supported; expected one of "
                      f"{tuple(_HF_ARCH)}")
  if model_type == "mistral" and cfg.get("sliding_window") not in (None, 0):
    # Full attention equals sliding-window attention as long as the context stays inside the window.
    pass
  n_heads = int(cfg["num_attention_heads"])
  dim = int(cfg["hidden_size"])
  theta, scaling = _rope_from_hf(cfg)
  eos = cfg.get("eos_token_id")
  eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
  qkv_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
  return ModelConfig(
      architecture=_HF_ARCH[model_type],
      vocab_size=int(cfg["vocab_size"]),
      dim=dim,
      n_layers=int(cfg["num_hidden_layers"]),
      n_heads=n_heads,
      n_kv_heads=int(_first(cfg, "num_key_value_heads", default=n_heads)),
      head_dim=int(_first(cfg, "head_dim", default=dim // n_heads)),
      ffn_dim=int(cfg["intermediate_size"]),
      norm_eps=float(_first(cfg, "rms_norm_eps", default=1e-5)),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position=int(_first(cfg, "max_position_embeddings", default=4096)),
      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      qkv_bias=qkv_bias,
      bos_token_id=cfg.get("bos_token_id"),
      eos_token_ids=tuple(int(e) for e in eos_ids),
      name=name or str(cfg.get("_name_or_path", "")))
