"""specache_jax: SpeCache (ICML 2025) in JAX — speculative KV caching with a low-bit device copy."""
from specache_jax import compile_cache as _compile_cache

_compile_cache.configure()       # before any program compiles (specache_jax.compile_cache says why)

from specache_jax.api import forward, generate, pad_prompts  # noqa: E402,F401
from specache_jax.caches import METHOD_NAMES, cache_config  # noqa: E402,F401
from specache_jax.checkpoints.registry import load_model  # noqa: E402,F401
from specache_jax.errors import ConfigError  # noqa: E402,F401
from specache_jax.model_config import ModelConfig  # noqa: E402,F401
