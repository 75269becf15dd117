"""Layer math shared by every path: RMSNorm, RoPE (default / linear / llama3), SwiGLU.

Axis letters (docs/design.md): B batch, T query length, N query heads, K KV heads, H head dim, D model dim, F hidden.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax.dispatch import dense
from specache_jax.model_config import ModelConfig


def rms_norm(x, weight, eps: float):
  """x [..., D], weight [D]; statistics in float32 (as HF LlamaRMSNorm), result in x.dtype."""
  x32 = x.astype(jnp.float32)
  var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  y = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
  w = weight.astype(x.dtype).reshape((1,) * (x.ndim - 1) + weight.shape)
  return w * y


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
  """[H/2] float64 inverse frequencies after the configured scaling (numpy: a trace-time constant)."""
  h = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  sc = cfg.rope_scaling
  if sc.rope_type == "linear":
    return inv / sc.factor
  if sc.rope_type == "llama3":
    low_wavelen = sc.original_max_position / sc.low_freq_factor
    high_wavelen = sc.original_max_position / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)
  return inv


def rope_tables(positions_BT, cfg: ModelConfig):
  """positions [B, T] int -> (cos, sin), each float32 [B, T, 1, H] (HF rotate-half layout)."""
  inv = jnp.asarray(inv_frequencies(cfg), jnp.float32)                         # [H/2]
  angles_BTh = positions_BT.astype(jnp.float32)[:, :, None] * inv[None, None, :]  # [B, T, H/2]
  angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  return jnp.cos(angles_BTH), jnp.sin(angles_BTH)


def apply_rope(x, rope):
  """x [B, T, heads, H], rope = `rope_tables(...)` -> rotated x, same dtype."""
  cos, sin = rope
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def swiglu_mlp(x, lp):
  """x [B, T, D] -> [B, T, D] with the layer's w_gate/w_up [D, F] and w_down [F, D]."""
  gate_BTF, up_BTF = dense(x, lp["w_gate"], lp["w_up"])
  return dense(jax.nn.silu(gate_BTF) * up_BTF, lp["w_down"])
