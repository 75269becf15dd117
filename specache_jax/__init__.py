"""specache_jax: SpeCache (ICML 2025) in JAX — speculative KV caching with a low-bit device copy."""
from specache_jax.api import forward, generate, pad_prompts  # noqa: F401
from specache_jax.caches import METHOD_NAMES, cache_config  # noqa: F401
from specache_jax.checkpoints.registry import load_model  # noqa: F401
from specache_jax.errors import ConfigError  # noqa: F401
from specache_jax.model_config import ModelConfig  # noqa: F401
