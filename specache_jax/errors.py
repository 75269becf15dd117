"""The library's configuration error, below every other module (model/, caches/, checkpoints/ all raise it)."""
from __future__ import annotations


class ConfigError(ValueError):
  """A model, cache or run configuration that cannot work, with the value and the rule it broke."""
