"""Test setup: 8 forced CPU devices (sharding tests), strict rank promotion, a persistent compile cache."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
_cache = os.environ.get("SPECACHE_JAX_COMPILE_CACHE")
if _cache:
  jax.config.update("jax_compilation_cache_dir", _cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
