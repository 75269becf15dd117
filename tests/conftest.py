"""Test setup: 8 forced CPU devices (sharding tests), strict rank promotion, a persistent compile cache."""
import os

# LLVM at -O0 for XLA:CPU's generated code: most of a test's time is compiling small programs once (a cold run on
# 2 cores: 1432 s at the default level, 918 s at -O0); the custom calls, matmuls and convolutions are prebuilt and
# as fast. Tests compare paths compiled alike and time nothing; benchmarks and experiments keep the default.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests' persistent compilation cache is the library's own (specache_jax.compile_cache), in `.pytest_cache/xla`:
# SPECACHE_JAX_COMPILE_CACHE is set here, in the environment, so that the xdist workers and every subprocess a test
# starts (launchers, the GPU check's dry run, the notebook, fresh-venv installs) configure the same folder when they
# import the library: the fixture below drops the compiled programs after each module, and many modules and
# subprocesses compile the same ones. Entries are keyed by the program, its compile options, the XLA flags (-O0
# here) and the jax/jaxlib versions, so a kept folder only speeds up reruns; a whole run writes ~100 MB, and a
# folder past compile_cache.MAX_BYTES (2 GiB) is trimmed to half when a process starts. SPECACHE_JAX_COMPILE_CACHE=
# <folder> set outside puts it elsewhere, =0 turns it off; a JAX_COMPILATION_CACHE_DIR already set is left as it is.
os.environ.setdefault("SPECACHE_JAX_COMPILE_CACHE",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                                   "xla"))

import jax  # noqa: E402

from specache_jax import compile_cache  # noqa: E402

compile_cache.configure()              # (importing specache_jax does it too; here before any test's first program)
jax.config.update("jax_numpy_rank_promotion", "raise")


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
