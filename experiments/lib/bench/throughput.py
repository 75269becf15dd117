"""Generation throughput per method: prefill and decode timed apart, tokens/s, per-step latency, device and
host bytes, bytes moved per step; ratios to the full cache in the same (context, batch) cell.

Methods run two ways: the jitted single-program path (`full`, `kivi`, SpeCache simulated: prefill + pre-decoding
compiled ahead of time, then one jitted decode step per token) and the offloaded runtime (`offload=True`:
per-layer dispatch, 16-bit cache in host memory). Both decode greedily with the next input computed on the
device (no host sync between steps), timed over back-to-back steps after warm-up, the methods of a cell in
interleaved rounds (so a change of load on a shared machine hits them alike).
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from experiments.lib import methods as exp_methods
from experiments.lib.bench import overlap, states, timing
from experiments.lib.bench.common import RuntimeDriver, error_reason, random_prompts
from specache_jax import decode
from specache_jax.arrays import tree_nbytes
from specache_jax.model import decoder as dec


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_len"))
def prefill_jit(params, tokens_BT, lengths_B, *, cfg, method, max_len):
  """Prefill (+ SpeCache's pre-decoding pass) -> (first decode input [B, W] int32, per-layer cache), laid out
  as `decode.start_jit` lays it out (the stacked layer scan, then `per_layer`). params: stacked."""
  cache = decode.init_cache(method, cfg, tokens_BT.shape[0], max_len, params["embed"].dtype)
  logits, cache = decode.prefill(params, cfg, method, tokens_BT, lengths_B, cache)
  inp, cache, _ = decode.start(params, cfg, method, decode.guess(logits), cache)
  return inp, dec.per_layer(cache, cfg.n_layers)


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnums=(2,))
def decode_step_jit(layer_params, inp_BW, cache, *, cfg, method):
  """One greedy step: [T_t(, T'_{t+1})] -> [T_{t+1}(, T'_{t+2})], cache (per-layer, donated: updated in
  place, as in the decode loop). layer_params: `decoder.unstack_params(params)` (no weight slicing per step)."""
  logits, cache, _ = dec.forward(layer_params, cfg, inp_BW, cache, method, "decode")
  return decode.next_input(method, inp_BW, decode.guess(logits[:, 0]), logits, cache.tokens, cache.lengths), cache


unstack_params_jit = jax.jit(dec.unstack_params, static_argnums=(1,))


class StateStepper:
  """Greedy decoding-loop steps (`decode_step_jit`) from a cache state built directly (`states.build_cache` on
  a capture, then the pre-decoding pass), no prompt run. `carry` = (next input [B, W], per-layer cache).
  layer_params: `unstack_params_jit(params, L)` (shared by the methods of a cell)."""

  def __init__(self, params, layer_params, cfg, method, captured, first_B, lengths_B, slots: int):
    self.layer_params, self.cfg, self.method = layer_params, cfg, method
    cache = states.build_cache(captured, lengths_B, cfg=cfg, method=method, max_len=slots)
    self.carry = timing.block(states.first_decode_input(params, first_B, cache, cfg=cfg, method=method))

  def _step(self, carry):
    return decode_step_jit(self.layer_params, carry[0], carry[1], cfg=self.cfg, method=self.method)

  def step(self):
    """One step on the carry (the cache donated) -> the new carry (not blocked on)."""
    self.carry = self._step(self.carry)
    return self.carry

  def chain(self, n: int) -> float:
    """Seconds per step over n back-to-back steps."""
    sec, self.carry = timing.time_chain(self._step, self.carry, 0, n)
    return sec


def transfer_formula(cfg, method, batch: int, dtype) -> dict:
  """Bytes per decoding step: host->device 2·k·K·H·bytes·L·B (the κ rows of K and V, SpeCache) and
  device->host 2·K·H·bytes·L·B (offloaded only: the real rows reach the host a ring of R at a time every R
  steps, one row per step on average when the batch's lengths agree mod R; ragged rows flush at different
  steps and each flush moves every row's ring, up to B times this)."""
  item = jnp.dtype(dtype).itemsize
  row = 2 * cfg.n_kv_heads * cfg.head_dim * item * cfg.n_layers * batch
  if method.name != "specache":
    return {"h2d": 0, "d2h": 0}
  return {"h2d": row * method.topk, "d2h": row if method.offload else 0}


def fetched_bytes(layer_states) -> int:
  """Bytes of the fetched κ rows held by the states (a list of per-layer states or one stacked state)."""
  seq = layer_states if isinstance(layer_states, (list, tuple)) else [layer_states]
  return int(sum(s.fetched_k.nbytes + s.fetched_v.nbytes for s in seq))


class JitRunner:
  """A jitted-path method in one cell: prefill compiled ahead of time, then greedy decode steps."""
  mode = "jit"

  def __init__(self, model, method, tokens, lengths, slots: int):
    self.params, self.cfg, self.method, self.slots = model.params, model.config, method, slots
    self.layer_params = unstack_params_jit(model.params, model.config.n_layers)
    self.toks, self.lens = jnp.asarray(tokens), jnp.asarray(lengths)
    t0 = time.perf_counter()
    self.prefill_fn = prefill_jit.lower(self.params, self.toks, self.lens, cfg=self.cfg, method=method,
                                        max_len=slots).compile()
    self.record = {"mode": self.mode, "slots": slots, "prefill_compile_s": time.perf_counter() - t0}
    self.carry = None

  def prefill(self) -> float:
    sec, self.carry = timing.timed(lambda: self.prefill_fn(self.params, self.toks, self.lens))
    return sec

  def _step(self, carry):
    return decode_step_jit(self.layer_params, carry[0], carry[1], cfg=self.cfg, method=self.method)

  def chain(self, n: int, warmup: int = 0) -> float:
    sec, self.carry = timing.time_chain(self._step, self.carry, warmup, n)
    return sec

  def finish(self) -> dict:
    method, layers = self.method, self.carry[1].layers
    return dict(self.record, device_bytes=method.device_bytes(layers), host_bytes=method.host_bytes(layers),
                resident_bytes=tree_nbytes(layers),
                h2d_bytes_per_step=fetched_bytes(layers) if method.name == "specache" else 0,
                d2h_bytes_per_step=0,
                note="SpeCache simulated: the 16-bit cache is a device array (host_bytes counted, not moved)"
                     if method.name == "specache" else "")


class OffloadRunner:
  """An offloaded-runtime method in one cell; prefill runs twice (the first compiles the per-layer calls)."""
  mode = "offload"

  def __init__(self, model, method, tokens, lengths, slots: int):
    self.model, self.method, self.tokens, self.lengths = model, method, tokens, lengths
    self.drv = RuntimeDriver(model, method, tokens.shape[0], slots, tokens.shape[1])
    self.record = {"mode": self.mode, "slots": slots}
    self.carry = None

  def _prefilled(self):
    carry = self.drv.prefill(self.tokens, self.lengths)
    timing.block(self.drv.sync(carry))
    return carry

  def prefill(self) -> float:
    self.record["prefill_first_s"], _ = timing.timed(self._prefilled)
    sec, self.carry = timing.timed(self._prefilled)
    return sec

  def chain(self, n: int, warmup: int = 0) -> float:
    sec, self.carry = timing.time_chain(self.drv.step, self.carry, warmup, n, sync=self.drv.sync)
    return sec

  def finish(self) -> dict:
    rt, method = self.drv.rt, self.method
    return dict(self.record, store=rt.store.kind, device_bytes=rt.device_bytes(), host_bytes=int(rt.store.nbytes),
                resident_bytes=int(sum(tree_nbytes(s) for s in rt.states)),
                h2d_bytes_per_step=fetched_bytes(rt.states),
                d2h_bytes_per_step=transfer_formula(self.model.config, method, self.tokens.shape[0],
                                                    self.model.params["embed"].dtype)["d2h"],
                note=("" if method.speculation.width > 1
                      else "non-speculative: κ_t chosen and fetched before attention"),
                **({"speculation_miss_rate": self.drv.miss_rows / self.drv.seen_rows} if self.drv.seen_rows else {}))


def make_runner(model, method, tokens, lengths, slots: int):
  cls = OffloadRunner if method.offload else JitRunner
  return cls(model, method, tokens, lengths, slots)


def time_cell(runners: dict, warmup: int, steps: int, rounds: int, batch: int, model) -> dict[str, dict]:
  """Prefill each method (timed), warm its decoding up, then `rounds` rounds in which every method decodes
  `steps` steps back to back, in a rotating order; step_s = median over rounds of seconds per step."""
  out, samples = {}, {label: [] for label in runners}
  for label, r in runners.items():
    r.record["prefill_s"] = r.prefill()
    r.chain(1, warmup=max(warmup - 1, 0))
  labels = list(runners)
  for i in range(rounds):
    for label in labels[i % len(labels):] + labels[:i % len(labels)]:
      samples[label].append(runners[label].chain(steps))
  for label, r in runners.items():
    rec = r.finish()
    rec["step_s"] = statistics.median(samples[label])
    rec["rounds_step_s"] = samples[label]
    rec.update(method=exp_methods.describe(r.method), tokens_per_s=batch / rec["step_s"],
               formula=transfer_formula(model.config, r.method, batch, model.params["embed"].dtype))
    out[label] = rec
  return out


def run(config, model, log: Callable[[str], None] = print) -> dict:
  """The sweep (+ the overlap measurement) -> a JSON-ready dict {meta, cells, overlap}."""
  t_start = time.perf_counter()
  deadline = t_start + float(config.max_seconds)
  labels = exp_methods.labels(config)
  meta = {"benchmark": "throughput", "model": model.source, "model_config": model.config.name,
          "dtype": str(model.params["embed"].dtype), "machine_start": timing.machine_info(),
          "warmup": config.warmup, "decode_steps": config.steps, "rounds": config.rounds,
          "reference": config.reference,
          "methods": {label: exp_methods.spec_of(config, label) for label in labels}}
  cells = []
  dtype = model.params["embed"].dtype
  for context in config.contexts:
    for batch in config.batches:
      prompt_len = int(context) - config.margin
      tokens, lengths = random_prompts(config.seed + int(context), int(batch), prompt_len,
                                       model.config.vocab_size)
      cell = {"context": int(context), "batch": int(batch), "prompt_len": prompt_len, "methods": {}}
      cells.append(cell)
      slots = states.cell_slots(prompt_len, config.warmup + config.rounds * config.steps + 1)
      runners = {}
      for label in labels:
        if time.perf_counter() > deadline:
          cell["methods"][label] = {"skipped": "out of time (config.max_seconds)"}
          continue
        try:
          method = exp_methods.build(config, label, model.config, slots, dtype)
          runners[label] = make_runner(model, method, tokens, lengths, slots)
        except Exception as e:  # a cell that cannot run (memory) is recorded, not fatal
          cell["methods"][label] = {"skipped": error_reason(e)}
      try:
        cell["methods"].update(time_cell(runners, config.warmup, config.steps, config.rounds, int(batch), model))
      except Exception as e:
        cell["methods"].update({label: {"skipped": f"while timing: {error_reason(e)}"} for label in runners})
      del runners
      cell["methods"] = {label: cell["methods"][label] for label in labels}
      for label, rec in cell["methods"].items():
        log(f"S={context} B={batch} {label}: " + (
            f"prefill {rec['prefill_s']:.2f} s, {rec['step_s'] * 1e3:.1f} ms/step, "
            f"{rec['tokens_per_s']:.1f} tok/s" if "step_s" in rec else rec["skipped"]))
      timing.add_ratios(cell, config.reference, ("tokens_per_s", "step_s", "prefill_s", "device_bytes"),
                        measured="step_s")
  result = {"meta": meta, "cells": cells}
  if config.overlap.enabled:
    if time.perf_counter() > deadline:
      result["overlap"] = {"skipped": "out of time (config.max_seconds)"}
    else:
      result["overlap"] = overlap.run_configured(config, log)
  meta["machine_end"] = timing.machine_info()
  meta["seconds"] = time.perf_counter() - t_start
  return result
