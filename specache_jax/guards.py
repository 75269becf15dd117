"""Numerical guards: an opt-in check that generation's logits and cache entries stay finite.

`sj.generate(..., check_numerics=True)` carries a small record through the jitted decode loop: the first
(step, phase, layer) at which a non-finite value (NaN or ±Inf) appeared, where layer = L stands for the logits.
Cache entries are checked per layer after every call (prefill, pre-decoding, each decoding step); the first bad
step and, within it, the lowest bad layer are kept. After the loop `raise_if_bad` turns the record into a
`NonFiniteError` naming them. A fault propagates forward through the layers, so the lowest layer whose cache is
bad is where the fault entered the K/V path — or the layer just before it, if the fault was in that layer's
query/output/MLP path (which shows up first in the next layer's cache, or in the logits after the last layer).

The offloaded runtime is per layer in Python; with check_numerics it calls `check_layers` on each layer's device
state and the hidden state after every phase (it waits for each step, so use it to debug, not to time).
Step numbering: step 0 is the prefill (it samples token 0); decoding step i samples token i; SpeCache's
pre-decoding pass (over token 0, before decoding step 1) counts as step 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PHASES = ("prefill", "predecode", "decode")
RECORD_KEY = "numerics"   # the key of the record in GenerateOutput.stats while the loop runs


class NonFiniteError(FloatingPointError):
  """NaN or Inf in the logits or in a layer's cache entries, with the step and the layer."""


def layer_finite(layers) -> jax.Array:
  """[L] bool: every floating leaf of the per-layer state (leaves [L, ...], or a tuple of per-layer states)
  is finite."""
  if isinstance(layers, (tuple, list)):
    return jnp.stack([_state_finite(st) for st in layers])
  ok = None
  for leaf in jax.tree.leaves(layers):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue                                          # packed codes, κ indices: integers
    flat = leaf.reshape(leaf.shape[0], -1)
    good = jnp.all(jnp.isfinite(flat), axis=1)          # [L]
    ok = good if ok is None else ok & good
  return ok


def empty_record() -> jax.Array:
  """[3] int32 (step, phase index, layer); -1 while everything is finite."""
  return jnp.full((3,), -1, jnp.int32)


def update(record, step, phase: str, logits, layers) -> jax.Array:
  """Keep the first bad (step, phase, layer); layer = L for the logits. step: int32 scalar."""
  ok_L = layer_finite(layers)
  n_layers = len(layers) if isinstance(layers, (tuple, list)) else jax.tree.leaves(layers)[0].shape[0]
  if ok_L is None:
    ok_L = jnp.ones((n_layers,), bool)
  bad_L = ~ok_L
  logits_ok = jnp.all(jnp.isfinite(logits))
  layer = jnp.where(jnp.any(bad_L), jnp.argmax(bad_L).astype(jnp.int32), jnp.int32(n_layers))
  now_bad = jnp.any(bad_L) | ~logits_ok
  new = jnp.stack([jnp.asarray(step, jnp.int32), jnp.int32(PHASES.index(phase)), layer])
  return jnp.where((record[0] < 0) & now_bad, new, record)


def describe(record, n_layers: int) -> str | None:
  """The message for a record, or None when everything stayed finite."""
  step, phase, layer = (int(x) for x in np.asarray(record))
  if step < 0:
    return None
  where = ("the logits (after the last layer: final norm / LM head, or layer "
           f"{n_layers - 1}'s output)" if layer >= n_layers else
           f"the cache entries of layer {layer} (of {n_layers}; the fault is in layer {layer}'s K/V path "
           f"or in layer {layer - 1}'s output)" if layer > 0 else
           f"the cache entries of layer 0 (of {n_layers}; the fault is in the embedding or layer 0's K/V path)")
  return f"non-finite values (NaN or Inf) first appeared at step {step} ({PHASES[phase]}) in {where}"


def raise_if_bad(record, n_layers: int) -> None:
  msg = describe(record, n_layers)
  if msg is not None:
    raise NonFiniteError(msg)


def pop_record(out):
  """Split the record out of a GenerateOutput's stats -> (output without it, record)."""
  stats = dict(out.stats)
  record = stats.pop(RECORD_KEY)
  return out.replace(stats=stats), record


def _state_finite(st) -> jax.Array:
  """bool: every floating leaf of one layer's state is finite."""
  leaves = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(st) if jnp.issubdtype(a.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


@jax.jit
def _states_and_x_finite(states, x):
  """Per-layer states (a list of per-layer trees) and an activation -> ([L] bool, bool)."""
  return jnp.stack([_state_finite(st) for st in states]), jnp.all(jnp.isfinite(x))


def check_layers(step: int, phase: str, states, x) -> None:
  """The offload runtime's check after a phase: raise NonFiniteError naming the step and the first bad layer
  (layer = L: the hidden state / logits). Waits for the step."""
  ok_L, x_ok = jax.device_get(_states_and_x_finite(list(states), x))
  n = len(ok_L)
  bad = np.flatnonzero(~ok_L)
  if len(bad) or not x_ok:
    raise_if_bad(np.asarray((step, PHASES.index(phase), int(bad[0]) if len(bad) else n)), n)
