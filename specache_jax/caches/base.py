"""What every cache method shares: the method protocol, the config base class with its optional hooks, the
per-row lengths wrapper.

A method lives in one file (`full.py`, `kivi.py`, `specache.py`, `streaming.py`, `h2o.py`): a frozen config
dataclass subclassing `CacheConfig`, and a module of pure functions (`MethodModule`) reached through
`method.impl`, never by comparing names. Hooks only some methods have (SpeCache's speculation record, host
bytes, pre-decoding) are declared here with their neutral default and overridden by the method's config, so
callers never probe with getattr/hasattr.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from specache_jax.errors import ConfigError
from specache_jax.model_config import ModelConfig


class MethodModule(Protocol):
  """The functions every method module provides (states are per layer unless said; `init` stacks [L, ...])."""

  def init(self, method: "CacheConfig", model_cfg: ModelConfig, batch: int, max_len: int, dtype) -> Any:
    """The empty state, leaves [L, ...]."""

  def prefill(self, method: "CacheConfig", st, k, v, lengths, colsum=None) -> Any:
    """Store a right-padded prompt: k, v [B,T,K,H] after RoPE, lengths [B], colsum [B,K,T] | None (H2O)."""

  def attend(self, method: "CacheConfig", st, q, k_new, v_new, lengths) -> tuple:
    """New rows q [B,T,N,H], k_new/v_new [B,T,K,H] after `lengths` stored tokens -> (out [B,T,N,H], st, aux)."""

  def device_bytes(self, method: "CacheConfig", st) -> int:
    """Bytes the state keeps in accelerator memory."""


class CacheConfig:
  """Base of every method's frozen config dataclass, with the optional hooks' defaults."""
  name: ClassVar[str] = ""
  # Query rows per decoding step (SpeCache: 1 real + its speculative candidates) and rows stored of them.
  decode_width: ClassVar[int] = 1
  needs_attention_colsum: ClassVar[bool] = False
  uses_predecode: ClassVar[bool] = False      # the module has predecode(method, st, q, k, v, lengths)
  offload: bool = False                       # the 16-bit cache lives in host memory (runtime.py runs it)

  @property
  def lookup_ngram(self) -> int:
    """Prompt lookup (history.py): the longest suffix matched in the tokens so far; 0 = none."""
    return 0

  @property
  def anchor_rows(self) -> int:
    """Positions around each next-input row's lookup match that the method's fetch takes first; 0 = none."""
    return 0

  @property
  def anchor_min_match(self) -> int:
    """The shortest repeat (tokens) that anchors a row (`anchor_rows`)."""
    return 1

  @property
  def keeps_tokens(self) -> bool:
    """Whether the cache carries the ids of its tokens (`Cache.tokens`; lookups read them)."""
    return self.lookup_ngram > 0

  @property
  def impl(self) -> MethodModule:
    raise NotImplementedError

  @classmethod
  def preset_settings(cls, preset: str, settings: dict) -> dict:
    """Hook: the settings of a named preset, with the explicitly given `settings` on top (they win)."""
    del settings
    raise ConfigError(f"cache method {cls.name!r} has no presets (got preset={preset!r})")

  def validate(self, model_cfg: ModelConfig, max_len: int) -> None:
    """Raise ConfigError naming the value and the rule; called before anything is compiled."""

  def row_offsets(self, t: int) -> tuple[int, ...]:
    """Positions of a decoding call's T new rows after the n stored tokens, as offsets from n: consecutive
    (n, n+1, ...) by default; SpeCache's candidate rows all sit at n + 1. A new row sees the new rows at earlier
    positions and itself (`attention.new_rows_mask`)."""
    return tuple(range(t))

  def rows_stored(self, t: int, phase: str) -> int:
    """How many of the T new rows of a call enter the cache (all, except SpeCache's speculative row)."""
    return t

  def slots(self, max_len: int) -> int:
    """The slot count S to allocate for `max_len` tokens (methods round up to their group sizes)."""
    return max_len

  def observe_speculation(self, st, missed_B, anchors_BW=None):
    """Hook: before the next step, which rows' speculative token was wrong and where each row of the next input
    would copy from (`history.anchors`, or None) (a state of any layout)."""
    del missed_B, anchors_BW
    return st

  def host_bytes(self, st) -> int:
    """Hook: bytes of the state that belong to host memory (SpeCache's complete 16-bit cache)."""
    del st
    return 0

  def device_bytes(self, st) -> int:
    """Bytes of the state in accelerator memory (the module's `device_bytes`; a per-layer tuple is summed)."""
    if isinstance(st, (tuple, list)):
      return int(sum(self.device_bytes(s) for s in st))
    return int(self.impl.device_bytes(self, st))


def observe_speculation(method: CacheConfig, layers, missed_B, anchors_BW=None):
  """The hook over a stacked state or a per-layer tuple of states."""
  if isinstance(layers, (tuple, list)):
    return tuple(method.observe_speculation(st, missed_B, anchors_BW) for st in layers)
  return method.observe_speculation(layers, missed_B, anchors_BW)


@struct.dataclass
class Cache:
  layers: Any                 # the method's State: leaves [L, ...], or a tuple of per-layer States
  lengths: jax.Array          # [B] int32 tokens stored per row
  tokens: Any = None          # [B, S] int32 ids of the stored tokens where `method.keeps_tokens`, else None


def settings_of(method) -> dict[str, Any]:
  return {f.name: getattr(method, f.name) for f in dataclasses.fields(method)}


def check_int(name: str, value, minimum: int = 0) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


def stack_layers(n_layers: int, tree):
  """Give every leaf of a per-layer state a leading L axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n_layers,) + x.shape), tree)
