"""`python -m specache_jax.cpu_kernels`: builds the kernels' library for this CPU (or finds it built) and prints
the status. Exit status 1 only when a compiler is there and fails on the sources (a defect); no compiler, or a
target this CPU cannot run, is 0: the models keep XLA's ops and say why."""
import sys

from specache_jax import cpu_kernels
from specache_jax.cpu_kernels import build as native

status = cpu_kernels.status()
print(f"CPU kernels {status}")
sys.exit(1 if status.startswith("unavailable: compiling") and native.compiler() is not None else 0)
