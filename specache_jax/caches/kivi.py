"""KIVI: the whole cache in low bits (keys per channel, values per token) plus a 16-bit residual window; its
attention is the mixed low-bit + 16-bit kernel's (`specache_jax.dispatch.mixed_attention`, by attention_impl)."""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax import dispatch, quant
from specache_jax.arrays import tree_nbytes
from specache_jax.caches import attention as A
from specache_jax.caches import lowbit
from specache_jax.caches.base import CacheConfig, check_int, stack_layers
from specache_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class KiviConfig(CacheConfig):
  name = "kivi"
  bits: int = 2                 # 1, 2, 4 or 8
  group_size: int = 32          # g
  residual: int = 128           # R, 16-bit recent tokens (g | R)
  one_bit: str = "kivi"         # the 1-bit rule: "kivi" (levels m, M) or "specache"
  attention_impl: str = "auto"  # the kernel family (specache_jax.dispatch.IMPLS): auto | jnp | cpu | pallas |
                                # pallas_tpu | pallas_interpret | pallas_tpu_interpret

  def __post_init__(self):
    if self.bits not in quant.BITS:
      raise ConfigError(f"bits={self.bits!r} must be one of {quant.BITS}")
    check_int("group_size", self.group_size, 1)
    check_int("residual", self.residual, 1)
    if self.residual % self.group_size:
      raise ConfigError(f"group_size={self.group_size} must divide residual={self.residual} "
                        "(keys are quantized a whole residual window at a time)")
    if self.one_bit not in quant.ONE_BIT_RULES:
      raise ConfigError(f"one_bit={self.one_bit!r} must be one of {quant.ONE_BIT_RULES}")
    dispatch.check_impl(self.attention_impl)

  @property
  def impl(self):
    return sys.modules[__name__]

  def validate(self, model_cfg, max_len):
    try:
      quant.validate(self.bits, self.group_size, model_cfg.head_dim, self.residual)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    dispatch.check_layout(self.attention_impl, self.bits, self.group_size, model_cfg.head_dim)

  def slots(self, max_len):
    return lowbit.round_slots(max_len, self.residual)

  @property
  def qargs(self):
    return dict(bits=self.bits, group_size=self.group_size, residual=self.residual, one_bit=self.one_bit)


@struct.dataclass
class State:
  low: lowbit.LowBit


def init(method: KiviConfig, model_cfg, batch, max_len, dtype) -> State:
  method.validate(model_cfg, max_len)
  low = lowbit.init(batch, model_cfg.n_kv_heads, method.slots(max_len), model_cfg.head_dim, method.bits,
                    method.group_size, method.residual, dtype)
  return stack_layers(model_cfg.n_layers, State(low=low))


def prefill(method: KiviConfig, st: State, k, v, lengths, colsum=None) -> State:
  del colsum
  return State(low=lowbit.prefill(st.low, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths,
                                  **method.qargs))


def attend(method: KiviConfig, st: State, q, k_new, v_new, lengths):
  """The new rows over the low-bit copy, the 16-bit ring and each other (causal); all T rows are stored.

  The rows' codes are stored first (the big code buffers are then written in place: this step reads positions
  below the old quantization boundaries, which the new rows' codes never touch); attention reads the ring as it
  was before them, and the rows go into it after (`lowbit.store_ring`)."""
  b, t, _, _ = q.shape
  n_kv = k_new.shape[2]
  kn, vn = jnp.swapaxes(k_new, 1, 2), jnp.swapaxes(v_new, 1, 2)
  low, _ = lowbit.store_codes(st.low, kn, vn, lengths, **method.qargs)
  s = low.k_codes.shape[2]
  _, val_qlen = lowbit.boundaries(lengths, method.residual)
  ring_k, ring_v, ring_pos = lowbit.ring_segment(low, lengths, bits=method.bits, group_size=method.group_size,
                                                 residual=method.residual)
  ring_mask = (ring_pos >= 0)[:, :, None, :]                            # [B, K, 1, R]
  ring_mask = jnp.broadcast_to(ring_mask, (b, n_kv, t, method.residual))
  new_mask = A.causal_new_mask(b, t)
  sm_scale = q.shape[-1] ** -0.5

  def jnp_attention():
    return A.segmented_attention(
        q, [lowbit.packed_segment(low, A.valid_cols_mask(val_qlen, s, t), bits=method.bits,
                                  group_size=method.group_size), (ring_k, ring_v, ring_mask),
            (kn, vn, new_mask)], sm_scale, n_kv)[0]

  # the fused kernel (its probabilities unused) over the ring and the new rows (two extra segments), or jnp
  out = dispatch.mixed_attention(
      method.attention_impl, jnp_attention, q, low, val_qlen, jnp.zeros((b, n_kv, 0), jnp.int32), [ring_k, kn],
      [ring_v, vn], jnp.concatenate([ring_mask, jnp.broadcast_to(new_mask, (b, n_kv, t, t))], -1),
      bits=method.bits, group_size=method.group_size, sm_scale=sm_scale, probabilities=False)
  return out, State(low=lowbit.store_ring(low, kn, vn, lengths, after=out)), {}


def device_bytes(method, st: State) -> int:
  return tree_nbytes(st)
