"""`python -m specache_jax.cpu_kernels`: builds the kernels' library for this CPU (or finds it built) and prints
the status. Exit status 1 only when a compiler is there and fails on the sources (a defect); no compiler, or a
target this CPU cannot run, is 0: the models keep XLA's ops and say why. Nothing is built where the default
backend is not the CPU."""
import sys

import jax

from specache_jax import cpu_kernels
from specache_jax.cpu_kernels import build as native

if jax.default_backend() != "cpu":                       # the kernels serve XLA:CPU programs only
  print(f"CPU kernels not built: the default backend is {jax.default_backend()}")
  sys.exit(0)
status = cpu_kernels.status()
print(f"CPU kernels {status}")
sys.exit(1 if status.startswith("unavailable: compiling") and native.compiler() is not None else 0)
