"""specache_jax: SpeCache (ICML 2025) in JAX — speculative KV caching with a low-bit device copy."""
from specache_jax.api import forward, generate, pad_prompts  # noqa: F401
from specache_jax.caches import METHOD_NAMES, cache_config  # noqa: F401
from specache_jax.model.config import ConfigError, ModelConfig  # noqa: F401


def load_model(path_or_name: str = "smollm2-135m", **kwargs):
  """Load a model by registered name, GGUF file, HF directory or orbax directory (see checkpoints/)."""
  from specache_jax.checkpoints.registry import load_model as _load
  return _load(path_or_name, **kwargs)
