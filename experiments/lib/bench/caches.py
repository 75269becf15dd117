"""Decode step time of every cache method on a prefilled cache, as ratios to `full` measured in the same run,
plus each method's device bytes measured on its real state arrays.

A step is the decoding loop's step, `throughput.decode_step_jit` (all layers over per-layer weights, the LM
head, the greedy next input; the per-layer cache donated, so updated in place), timed call by call after warm-up
and blocked on the next input and the new cache; input and cache are threaded through the calls as in a
decoding loop. Each (context, batch) cell prefills its prompts once (`states`), builds
every method's state from that, and times the methods in interleaved rounds (robust to a shared machine).
"""
from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp

from experiments.lib import methods as exp_methods
from experiments.lib.bench import profile, states, timing
from experiments.lib.bench.common import error_reason, random_prompts
from specache_jax.arrays import tree_nbytes
from specache_jax.caches import budget
from experiments.lib.bench.throughput import StateStepper, unstack_params_jit


class Stepper(StateStepper):
  """One method's prefilled cache and decode input (`carry`); `step()` runs one decoding-loop step, and
  `record` holds the method, its bytes and the build time."""

  def __init__(self, params, layer_params, cfg, method, captured, first_B, lengths_B, max_len):
    t0 = time.perf_counter()
    super().__init__(params, layer_params, cfg, method, captured, first_B, lengths_B, max_len)
    layers = self.carry[1].layers
    self.record = {"method": exp_methods.describe(method), "slots": max_len,
                   "device_bytes": method.device_bytes(layers), "resident_bytes": tree_nbytes(layers),
                   "build_s": time.perf_counter() - t0}


def time_interleaved(steppers: dict[str, Stepper], warmup: int, iters: int) -> None:
  """Warm each method up (its first call compiles; timed apart), then time `iters` rounds in which every
  method runs one blocked step, in a rotating order — so a change of machine load hits all methods alike.
  Writes rec["step"] into each stepper's record."""
  samples = {label: [] for label in steppers}
  for label, st in steppers.items():
    st.record["first_call_s"], _ = timing.timed(st.step)
    for _ in range(max(warmup - 1, 0)):
      timing.block(st.step())
  labels = list(steppers)
  for i in range(iters):
    for label in labels[i % len(labels):] + labels[:i % len(labels)]:
      sec, _ = timing.timed(steppers[label].step)
      samples[label].append(sec)
  for label, st in steppers.items():
    st.record["step"] = timing.summarize(samples[label])


def bytes_16bit(config, label: str, cfg, max_len: int, batch: int) -> int:
  """The method's device bytes with a bfloat16 model (the paper's 16-bit setting), from the state's shapes
  (eval_shape; nothing allocated) — for runs whose model is float32."""
  method = exp_methods.build(config, label, cfg, max_len, jnp.bfloat16)
  return budget.device_bytes_at(method, cfg, max_len, jnp.bfloat16, batch)


def _skip(reason: str) -> dict:
  return {"skipped": reason}


def run_context(config, model, context: int, deadline: float, log: Callable[[str], None],
                keep: dict | None = None) -> list[dict]:
  """All (batch, method) cells of one context length; prompts prefilled row by row, once, as the cells need
  them (smallest batch first). `keep`, if given, receives keep[batch] = (first [B], Captured, lengths [B])
  for each batch it has a key for (reused by the profile)."""
  cfg, params = model.config, model.params
  dtype = params["embed"].dtype
  layer_params = unstack_params_jit(params, cfg.n_layers)
  labels = exp_methods.labels(config)
  prompt_len = context - config.margin
  steps = config.warmup + config.iters
  if prompt_len < 1:
    raise ValueError(f"context={context} must exceed margin={config.margin}")
  batches = sorted(int(b) for b in config.batches)
  tokens, lengths = random_prompts(config.seed + context, batches[-1], prompt_len, cfg.vocab_size)
  firsts, parts, row_s = [], [], []
  cells = []
  for batch in batches:                       # ascending: the batch-1 cell runs before more rows are prefilled
    while len(parts) < batch:
      est = max(row_s) if row_s else 0.0
      if parts and (time.perf_counter() + est > deadline or sum(row_s) + est > config.max_prefill_s):
        break
      t0 = time.perf_counter()
      first, cap = states.capture(params, cfg, tokens[len(parts):len(parts) + 1],
                                  lengths[len(parts):len(parts) + 1])
      timing.block(cap)
      row_s.append(time.perf_counter() - t0)
      firsts.append(first)
      parts.append(cap)
      log(f"context {context}: prefilled row {len(parts) - 1} in {row_s[-1]:.1f} s")
    cell = {"context": context, "batch": batch, "prompt_len": prompt_len, "decode_steps": steps,
            "prefill_s_per_row": list(row_s), "distinct_prompt_rows": min(len(parts), batch), "methods": {}}
    cells.append(cell)
    if time.perf_counter() > deadline:
      cell["skipped"] = "out of time (config.max_seconds)"
      continue
    if len(parts) < batch:                    # out of prefill time: reuse the rows prefilled (recorded)
      cell["note"] = (f"only {len(parts)} distinct prompt rows prefilled within max_prefill_s="
                      f"{config.max_prefill_s} ({row_s[0]:.0f} s per row); rows repeat cyclically")
      log(f"context {context} batch {batch}: {cell['note']}")
    rows = [i % len(parts) for i in range(batch)]
    cat = lambda *xs: jax.numpy.concatenate(xs, axis=1)
    captured = parts[0] if batch == 1 else jax.tree.map(cat, *[parts[i] for i in rows])
    first = jax.numpy.concatenate([firsts[i] for i in rows])
    lens = jax.numpy.asarray(lengths[:batch])                              # all rows have prompt_len tokens
    if keep is not None and batch in keep:
      keep[batch] = (first, captured, lens)
    max_len = states.cell_slots(prompt_len, steps)
    steppers = {}
    for label in labels:
      if time.perf_counter() > deadline:
        cell["methods"][label] = _skip("out of time (config.max_seconds)")
        continue
      try:
        method = exp_methods.build(config, label, cfg, max_len, dtype)
        steppers[label] = Stepper(params, layer_params, cfg, method, captured, first, lens, max_len)
        steppers[label].record["device_bytes_16bit"] = bytes_16bit(config, label, cfg, max_len, batch)
        cell["methods"][label] = steppers[label].record
      except Exception as e:  # a cell that cannot run (memory) is recorded, not fatal
        cell["methods"][label] = _skip(error_reason(e))
        log(f"context {context} batch {batch} {label}: {cell['methods'][label]['skipped']}")
    try:
      time_interleaved(steppers, config.warmup, config.iters)
    except Exception as e:
      for label in steppers:
        cell["methods"][label] = _skip(f"while timing: {error_reason(e)}")
    del steppers
    for label, rec in cell["methods"].items():
      if "step" in rec:
        log(f"context {context} batch {batch} {label}: {rec['step']['median_s'] * 1e3:.1f} ms/step")
    timing.add_ratios(cell, config.reference, ("step", "device_bytes", "device_bytes_16bit"), measured="step",
                      value=_median_or_value)
  return cells


def _median_or_value(rec: dict, key: str):
  """A record's number under `key`; for a timing summary (the step) its median seconds."""
  value = rec.get(key)
  return value.get("median_s") if isinstance(value, dict) else value


def target_check(cells: list[dict], config) -> dict:
  """Issue 3's target: every simulated SpeCache method's step ≤ target_ratio × full at the target context."""
  found = {}
  for cell in cells:
    if cell["context"] != config.target_context:
      continue
    for label, rec in cell["methods"].items():
      spec = rec.get("method", {})
      if spec.get("name") == "specache" and not spec.get("offload") and rec.get("step_ratio") is not None:
        found[f"{label}@batch{cell['batch']}"] = round(rec["step_ratio"], 3)
  met = bool(found) and all(r <= config.target_ratio for r in found.values())
  return {"rule": f"SpeCache (simulated) step <= {config.target_ratio} x full at context {config.target_context}",
          "ratios": found, "met": met if found else None}


def run(config, model, log: Callable[[str], None] = print) -> dict:
  """The whole sweep -> a JSON-ready dict {meta, cells, target, profiles}."""
  t_start = time.perf_counter()
  deadline = t_start + float(config.max_seconds)
  meta = {"benchmark": "caches", "model": model.source, "model_config": model.config.name,
          "dtype": str(model.params["embed"].dtype), "machine_start": timing.machine_info(),
          "warmup": config.warmup, "iters": config.iters, "reference": config.reference,
          "methods": {label: exp_methods.spec_of(config, label) for label in exp_methods.labels(config)}}
  cells = []
  profile_batches = [int(b) for b in config.profile_batches] if config.profile_context else []
  keep = {b: None for b in profile_batches}
  for context in config.contexts:
    cells.extend(run_context(config, model, int(context), deadline, log,
                             keep if int(context) == int(config.profile_context or -1) else None))
  result = {"meta": meta, "cells": cells, "target": target_check(cells, config), "profiles": []}
  for batch in profile_batches:
    if time.perf_counter() > deadline:
      result["profiles"].append({"batch": batch, "skipped": "out of time (config.max_seconds)"})
      continue
    label = config.profile_method
    slots = states.cell_slots(int(config.profile_context) - config.margin, config.iters + 2)
    method = exp_methods.build(config, label, model.config, slots, model.params["embed"].dtype)
    prof = profile.profile_specache_step(model, method, int(config.profile_context), config.margin, config.seed,
                                         config.iters, keep.get(batch), batch)
    prof["label"] = label
    result["profiles"].append(prof)
    log(f"profile batch {batch}: " + ", ".join(f"{k} {v['x_layers_s'] * 1e3:.0f} ms"
                                                 for k, v in prof["pieces"].items()))
  meta["machine_end"] = timing.machine_info()
  meta["seconds"] = time.perf_counter() - t_start
  return result
