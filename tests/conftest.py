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


import gc  # noqa: E402

import pytest  # noqa: E402


def _mapped_regions() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:                      # not Linux
    return -1


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
  """Drop every compiled executable after each test module.

  Each XLA:CPU executable keeps its JIT-compiled code in its own memory mappings; a whole-suite run compiles
  thousands of programs and, without this, the process passes Linux's `vm.max_map_count` (65530) and the next
  compilation dies with SIGSEGV/SIGABRT inside LLVM (seen in CI at ~80% of the suite).
  """
  yield
  jax.clear_caches()
  gc.collect()


def pytest_terminal_summary(terminalreporter):
  terminalreporter.write_line(f"memory mappings at the end of the session: {_mapped_regions()} "
                              "(Linux's default vm.max_map_count is 65530)")
