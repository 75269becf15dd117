"""Generation throughput per method: prefill and decode timed apart, tokens/s, per-step latency, device and
host bytes, bytes moved per step; ratios to the full cache in the same (context, batch) cell.

Methods run two ways: the jitted single-program path (`full`, `kivi`, SpeCache simulated: prefill + pre-decoding
compiled ahead of time, then one jitted decode step per token) and the offloaded runtime (`offload=True`:
per-layer dispatch, 16-bit cache in host memory). Both decode greedily with the next input computed on the
device (no host sync between steps), timed over back-to-back steps after warm-up.
"""
from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp

from specache_jax import decode
from specache_jax.bench import states, timing
from specache_jax.bench.caches import _error_reason, random_prompts
from specache_jax.caches.base import tree_nbytes
from specache_jax.experiments_lib import methods as exp_methods
from specache_jax.model import decoder as dec
from specache_jax.runtime import OffloadRuntime


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_len"))
def prefill_jit(params, tokens_BT, lengths_B, *, cfg, method, max_len):
  """Prefill (+ SpeCache's pre-decoding pass) -> (first decode input [B, W] int32, cache)."""
  cache = decode.init_cache(method, cfg, tokens_BT.shape[0], max_len, params["embed"].dtype)
  logits, cache, _ = dec.forward(params, cfg, tokens_BT, cache, method, "prefill", prompt_lengths=lengths_B,
                                 logits_at=lengths_B - 1)
  first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
  if not method.uses_predecode:
    return first[:, None], cache
  logits, cache, _ = dec.forward(params, cfg, first[:, None], cache, method, "predecode")
  return jnp.stack([first, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)], axis=1), cache


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def decode_step_jit(params, inp_BW, cache, *, cfg, method):
  """One greedy step: [T_t(, T'_{t+1})] -> [T_{t+1}(, T'_{t+2})], cache."""
  logits, cache, _ = dec.forward(params, cfg, inp_BW, cache, method, "decode")
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def greedy_rows(params, x_BWD, *, cfg):
  """Argmax of the LM head at every row: [B, W] int32 (row 0 the real token, row 1 the speculative one)."""
  return jnp.argmax(dec.lm_head(params, cfg, x_BWD), axis=-1).astype(jnp.int32)


def transfer_formula(cfg, method, batch: int, dtype) -> dict:
  """Bytes per decoding step: host->device 2·k·K·H·bytes·L·B (the κ rows of K and V, SpeCache) and
  device->host 2·K·H·bytes·L·B (the real row appended to the host cache, offloaded only)."""
  item = jnp.dtype(dtype).itemsize
  row = 2 * cfg.n_kv_heads * cfg.head_dim * item * cfg.n_layers * batch
  if method.name != "specache":
    return {"h2d": 0, "d2h": 0}
  return {"h2d": row * method.topk, "d2h": row if method.offload else 0}


def fetched_bytes(layer_states) -> int:
  """Bytes of the fetched κ rows held by the states (a list of per-layer states or one stacked state)."""
  seq = layer_states if isinstance(layer_states, (list, tuple)) else [layer_states]
  return int(sum(s.fetched_k.nbytes + s.fetched_v.nbytes for s in seq))


def jitted_cell(model, method, tokens, lengths, warmup: int, steps: int) -> dict:
  cfg, params = model.config, model.params
  max_len = states.cell_slots(tokens.shape[1], warmup + steps + 1)
  toks, lens = jnp.asarray(tokens), jnp.asarray(lengths)
  t0 = time.perf_counter()
  compiled = prefill_jit.lower(params, toks, lens, cfg=cfg, method=method, max_len=max_len).compile()
  compile_s = time.perf_counter() - t0
  prefill_s, (inp, cache) = timing.timed(lambda: compiled(params, toks, lens))
  step = lambda c: decode_step_jit(params, c[0], c[1], cfg=cfg, method=method)
  step_s, (inp, cache) = timing.time_chain(step, (inp, cache), warmup, steps)
  layers = cache.layers
  host = int(method.impl.host_bytes(method, layers)) if hasattr(method.impl, "host_bytes") else 0
  return {"mode": "jit", "slots": max_len, "prefill_compile_s": compile_s, "prefill_s": prefill_s,
          "step_s": step_s, "device_bytes": int(method.impl.device_bytes(method, layers)),
          "host_bytes": host, "resident_bytes": tree_nbytes(layers),
          "h2d_bytes_per_step": fetched_bytes(layers) if method.name == "specache" else 0,
          "d2h_bytes_per_step": 0,
          "note": "SpeCache simulated: the 16-bit cache is a device array (host_bytes counted, not moved)"
                  if method.name == "specache" else ""}


class RuntimeDriver:
  """Greedy decoding through an `OffloadRuntime` with the next input kept on the device."""

  def __init__(self, model, method, batch: int, max_len: int, prompt_len: int):
    self.params, self.cfg, self.method = model.params, model.config, method
    self.rt = OffloadRuntime(model.params, model.config, method, batch, max_len, prompt_len=prompt_len)

  def prefill(self, tokens_BT, lengths_B):
    """Prefill + pre-decoding -> carry (inp [B, W], lengths [B], pending fetches)."""
    lengths = jnp.asarray(lengths_B, jnp.int32)
    logits = self.rt.prefill(jnp.asarray(tokens_BT), lengths)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not self.method.speculative:
      return first[:, None], lengths, None
    x, pending = self.rt.predecode(first, lengths)
    spec = greedy_rows(self.params, x, cfg=self.cfg)                        # [B, 1]
    return jnp.concatenate([first[:, None], spec], axis=1), lengths, pending

  def step(self, carry):
    inp, lengths, pending = carry
    x, pending = self.rt.step(inp, lengths, pending)
    return greedy_rows(self.params, x, cfg=self.cfg), lengths + 1, pending

  def sync(self, carry):
    """What must be finished for the steps so far to count as done (incl. the issued fetches and appends)."""
    inp, lengths, pending = carry
    fetched = [p.result() for p in pending] if pending else []
    return inp, lengths, fetched, self.rt.states, self.rt.store.arrays()


def offload_cell(model, method, tokens, lengths, warmup: int, steps: int) -> dict:
  max_len = states.cell_slots(tokens.shape[1], warmup + steps + 1)
  drv = RuntimeDriver(model, method, tokens.shape[0], max_len, tokens.shape[1])

  def prefilled():
    carry = drv.prefill(tokens, lengths)
    timing.block(drv.sync(carry))
    return carry

  first_s, _ = timing.timed(prefilled)                                       # compiles the per-layer calls
  prefill_s, carry = timing.timed(prefilled)
  step_s, carry = timing.time_chain(drv.step, carry, warmup, steps, sync=drv.sync)
  rt = drv.rt
  return {"mode": "offload", "slots": max_len, "store": rt.store.kind, "prefill_first_s": first_s,
          "prefill_s": prefill_s, "step_s": step_s, "device_bytes": rt.device_bytes(),
          "host_bytes": int(rt.store.nbytes),
          "resident_bytes": int(sum(tree_nbytes(s) for s in rt.states)),
          "h2d_bytes_per_step": fetched_bytes(rt.states),
          "d2h_bytes_per_step": transfer_formula(model.config, method, tokens.shape[0],
                                                 model.params["embed"].dtype)["d2h"],
          "note": "" if method.speculative else "non-speculative: κ_t chosen and fetched before attention"}


def run_cell(model, method, tokens, lengths, warmup: int, steps: int) -> dict:
  cell = offload_cell if getattr(method, "offload", False) else jitted_cell
  rec = cell(model, method, tokens, lengths, warmup, steps)
  b = tokens.shape[0]
  rec.update(method=exp_methods.describe(method), tokens_per_s=b / rec["step_s"],
             formula=transfer_formula(model.config, method, b, model.params["embed"].dtype))
  return rec


def _add_ratios(cell: dict, reference: str) -> None:
  ref = cell["methods"].get(reference, {})
  for rec in cell["methods"].values():
    if "step_s" not in rec:
      continue
    for key in ("tokens_per_s", "step_s", "prefill_s", "device_bytes"):
      rec[key + "_ratio"] = timing.ratio(rec[key], ref.get(key))


def run(config, model, log: Callable[[str], None] = print) -> dict:
  """The sweep (+ the overlap measurement) -> a JSON-ready dict {meta, cells, overlap}."""
  t_start = time.perf_counter()
  deadline = t_start + float(config.max_seconds)
  labels = exp_methods.labels(config)
  meta = {"benchmark": "throughput", "model": model.source, "model_config": model.config.name,
          "dtype": str(model.params["embed"].dtype), "machine_start": timing.machine_info(),
          "warmup": config.warmup, "decode_steps": config.steps, "reference": config.reference,
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
      for label in labels:
        if time.perf_counter() > deadline:
          cell["methods"][label] = {"skipped": "out of time (config.max_seconds)"}
          continue
        try:
          slots = states.cell_slots(prompt_len, config.warmup + config.steps + 1)
          method = exp_methods.build(config, label, model.config, slots, dtype)
          rec = run_cell(model, method, tokens, lengths, config.warmup, config.steps)
        except Exception as e:  # a cell that cannot run (memory) is recorded, not fatal
          rec = {"skipped": _error_reason(e)}
        cell["methods"][label] = rec
        log(f"S={context} B={batch} {label}: " + (
            f"prefill {rec['prefill_s']:.2f} s, {rec['step_s'] * 1e3:.1f} ms/step, "
            f"{rec['tokens_per_s']:.1f} tok/s" if "step_s" in rec else rec["skipped"]))
      _add_ratios(cell, config.reference)
  result = {"meta": meta, "cells": cells}
  if config.overlap.enabled:
    from specache_jax.bench import overlap
    if time.perf_counter() > deadline:
      result["overlap"] = {"skipped": "out of time (config.max_seconds)"}
    else:
      result["overlap"] = overlap.run_configured(config, log)
  meta["machine_end"] = timing.machine_info()
  meta["seconds"] = time.perf_counter() - t_start
  return result
