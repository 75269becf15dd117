"""What every cache method shares: the method protocol, the config base class with its optional hooks, the
per-row lengths wrapper.

A method lives in one file (`full.py`, `kivi.py`, `specache.py`, `streaming.py`, `h2o.py`): a frozen config
dataclass subclassing `CacheConfig`, and a module of pure functions (`MethodModule`) reached through
`method.impl`, never by comparing names. Hooks only some methods have (host bytes, presets) are declared here with
their neutral default and overridden by the method's config, so callers never probe with getattr/hasattr. What a
method's speculation changes in the decode loop is one value, `method.speculation` (caches/speculation.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specache_jax.caches.speculation import NO_SPECULATION, Speculation
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


class OffloadModule(MethodModule, Protocol):
  """What the offloaded runtime (runtime.py) asks of a method whose 16-bit cache lives in the host store
  (`offload=True`: SpeCache, Quest, InfLLM). The runtime knows no method: it fetches rows at the positions these
  hooks name, installs them, and writes back the rows they flush. idx [B, K, X] int32: positions of the 16-bit
  rows a step reads from the host (SpeCache's κ)."""

  def prefetches(self, method: "CacheConfig") -> bool:
    """Whether a step ends knowing the next step's idx (`next_index`), so that fetch overlaps the later layers
    (SpeCache's speculation); else nothing is fetched ahead."""

  def next_index(self, method: "CacheConfig", st) -> jax.Array:
    """The idx the next step reads, recorded by this step's attend (only a module that `prefetches` has it)."""

  def fetches_on_critical_path(self, method: "CacheConfig") -> bool:
    """Whether a step may choose its idx from its own query (`kappa_for_step`) and wait for the fetch: every
    step where nothing is prefetched, else only after a miss (`Speculation`'s miss report)."""

  def kappa_for_step(self, method: "CacheConfig", st, q, k_new, v_new, lengths) -> jax.Array:
    """The idx of this step's attend, chosen now from the step's rows q [B,T,N,H], k/v_new [B,T,K,H]."""

  def with_fetched(self, method: "CacheConfig", st, idx_BKX, k_rows_BKXH, v_rows_BKXH) -> Any:
    """The state with the host rows at idx installed for the next attend."""

  def flushes(self, method: "CacheConfig", stored_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host-side (numpy, no device read): after a step that leaves stored_B [B] rows stored, (the batch rows
    whose device-held 16-bit rows go to the host now, start_B [B] the first position of each row's block)."""

  def flushed_rows(self, method: "CacheConfig", st, start_B: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """The block `flushes` named: k, v [B, K, R, H], row b's written at start_B[b].. of the host store."""


HOST_STORES = ("auto", "pinned_host", "numpy")   # offload.py: where the 16-bit cache lives when offloaded


def check_offload(offload, host_store) -> None:
  """The offload settings a retrieval method shares (`offload`, `host_store`)."""
  if not isinstance(offload, bool):
    raise ConfigError(f"offload={offload!r} must be a bool (True: the 16-bit cache in the host store)")
  if host_store not in HOST_STORES:
    raise ConfigError(f"host_store={host_store!r} must be one of {HOST_STORES}")


class CacheConfig:
  """Base of every method's frozen config dataclass, with the optional hooks' defaults."""
  name: ClassVar[str] = ""
  needs_attention_colsum: ClassVar[bool] = False
  offload: bool = False                       # the 16-bit cache lives in host memory (runtime.py runs it; the
                                              # module is then an `OffloadModule`)
  host_store: str = "auto"                    # where, when offloaded (offload.py)
  speculation: Speculation = NO_SPECULATION   # one row per step (SpeCache overrides it with a field)

  @property
  def impl(self) -> MethodModule:
    raise NotImplementedError

  @classmethod
  def resolve_settings(cls, preset: str | None, settings: dict) -> dict:
    """Hook: `cache_config(name, preset=..., **settings)`'s settings -> the config's fields (a named preset's
    settings under the given ones, which win). By default: the settings as given, and no presets."""
    if preset is not None:
      raise ConfigError(f"cache method {cls.name!r} has no presets (got preset={preset!r})")
    return settings

  def flat_settings(self) -> dict[str, Any]:
    """The settings as one flat JSON-ready dict (result records; `resolve_settings` reads it back)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def validate(self, model_cfg: ModelConfig, max_len: int) -> None:
    """Raise ConfigError naming the value and the rule; called before anything is compiled."""

  def slots(self, max_len: int) -> int:
    """The slot count S to allocate for `max_len` tokens (methods round up to their group sizes)."""
    return max_len

  def host_bytes(self, st) -> int:
    """Bytes of the state that belong to host memory (the module's `host_bytes` where it has one: the retrieval
    methods' complete 16-bit cache; else 0; a per-layer tuple is summed)."""
    if isinstance(st, (tuple, list)):
      return int(sum(self.host_bytes(s) for s in st))
    module_host_bytes = getattr(self.impl, "host_bytes", None)
    return 0 if module_host_bytes is None else int(module_host_bytes(self, st))

  def device_bytes(self, st) -> int:
    """Bytes of the state in accelerator memory (the module's `device_bytes`; a per-layer tuple is summed)."""
    if isinstance(st, (tuple, list)):
      return int(sum(self.device_bytes(s) for s in st))
    return int(self.impl.device_bytes(self, st))


@struct.dataclass
class Cache:
  layers: Any                 # the method's State: leaves [L, ...], or a tuple of per-layer States
  lengths: jax.Array          # [B] int32 tokens stored per row
  tokens: Any = None          # [B, S] int32 ids of the stored tokens where `method.speculation.keeps_tokens`


def settings_of(method) -> dict[str, Any]:
  """A built method's settings, flat and JSON-ready (`CacheConfig.flat_settings`)."""
  return method.flat_settings()


def check_int(name: str, value, minimum: int = 0) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


def stack_layers(n_layers: int, tree):
  """Give every leaf of a per-layer state a leading L axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n_layers,) + x.shape), tree)
