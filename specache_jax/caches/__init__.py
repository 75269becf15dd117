"""Cache methods behind one interface; `cache_config(name, **settings)` builds a method's config."""
from __future__ import annotations

import dataclasses
import difflib
import importlib

from specache_jax.caches.base import Cache, CacheConfig  # noqa: F401
from specache_jax.errors import ConfigError

_METHODS = {
    "full": ("specache_jax.caches.full", "FullConfig"),
    "kivi": ("specache_jax.caches.kivi", "KiviConfig"),
    "specache": ("specache_jax.caches.specache", "SpeCacheConfig"),
    "streaming": ("specache_jax.caches.streaming", "StreamingConfig"),
    "h2o": ("specache_jax.caches.h2o", "H2OConfig"),
    "quest": ("specache_jax.caches.quest", "QuestConfig"),
    "infllm": ("specache_jax.caches.infllm", "InfLLMConfig"),
}
METHOD_NAMES = tuple(_METHODS)


def config_class(name: str):
  if name not in _METHODS:
    close = difflib.get_close_matches(str(name), METHOD_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"cache method {name!r} is unknown{hint}; expected one of {METHOD_NAMES}")
  module, cls = _METHODS[name]
  return getattr(importlib.import_module(module), cls)


def cache_config(name: str = "full", preset: str | None = None, **settings) -> CacheConfig:
  """E.g. cache_config("specache", bits=1, group_size=64, residual=64, topk=64), or a named preset of the
  method's settings under any given explicitly: cache_config("specache", bits=1, preset="robust")."""
  cls = config_class(name)
  settings = cls.resolve_settings(preset, dict(settings))
  allowed = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(settings) - set(allowed))
  if unknown:
    raise ConfigError(f"unknown setting(s) {unknown} for cache method {name!r}; allowed: {allowed}")
  return cls(**settings)
