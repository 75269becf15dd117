"""Array basics below every other module: the weight dtypes by name, the bytes of a pytree, a result that is
already dispatched."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import dispatch

# The dtypes weights (and so activations and 16-bit caches) may have, by name: checkpoints load to them, the
# decoder runs them, configs name them (float64 runs too when jax_enable_x64 is on; validation says so).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def tree_nbytes(tree) -> int:
  """Bytes of every array leaf, from its shape and dtype (so also of `jax.eval_shape`'s ShapeDtypeStructs)."""
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def fusion_barrier(tree, holds):
  """`tree`, computed into buffers of its own on a CPU backend: XLA cannot fuse its producers into its consumers.

  holds: a bool scalar that is true at run time but not foldable at compile time (e.g. `all(lengths >= 0)`);
  on CPU the tree passes through a `lax.cond` on it (the other branch gives zeros). Used where XLA:CPU would
  otherwise recompute an expensive producer per element of a large consumer (an `optimization_barrier` does not
  survive its pipeline; a conditional does). Other platforms get the tree as is (`lax.platform_dependent`,
  resolved when lowering): a GPU conditional copies its predicate to the host and waits for it."""
  return dispatch.on_cpu_only(tree, holds, cpu=lambda t, h: jax.lax.cond(h, lambda x: x, _zeros, t),
                              default=lambda t, h: t)


def _zeros(tree):
  return jax.tree.map(jnp.zeros_like, tree)


class Ready:
  """A result whose arrays are already dispatched (they become ready asynchronously); `result()` returns it,
  as a `concurrent.futures.Future` would."""

  def __init__(self, value):
    self._value = value

  def result(self):
    return self._value
