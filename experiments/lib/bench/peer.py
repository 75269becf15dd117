"""The peer inside the benchmark: HF transformers (torch) on the same model, prompts and contexts as ours, timed in
the same run, round by round with our methods, and every figure set against the machine's limits.

Per (context, batch) cell, every runner — ours through `throughput.make_runner`, the peer's `HFRunner` (torch,
`DynamicCache` or quanto's `QuantizedCache`) — exposes the same three calls: `prefill()` -> seconds (time to the
first token), `chain(n)` -> seconds per greedy decode step over n back-to-back steps, `finish()` -> record.
`time_cell` prefills them in rotating order, warms their decoding up, then runs `rounds` rounds in which each
decodes `steps` steps in turn (a change of load on a shared machine hits all alike); medians are reported.

Bytes per step (from shapes): the weights (read once per step; a tied embedding counts once, as the LM head)
plus the cache the method attends at the cell's context S — ours: the method's accelerator state for S tokens
(`budget.device_bytes_at`: the 16-bit cache for `full`; codes, scales, residual and fetched rows for KIVI and
SpeCache), the peer's: the fp cache (DynamicCache) or the quanto codes + one scale and shift per group. The
floor of a step is those bytes at the machine's measured read bandwidth (`machine.py`); a prefill's floor is
its FLOPs (matmuls + causal attention + the last position's LM head) at the measured fp32 GEMM rate.

`scaling` times our decode step (the jitted runner's: per-layer cache donated, per-layer weights) from 1k to
32k on random weights of the model's shape, the cache state built directly from random K/V by each method's
own prefill (`states.build_cache`; timing only).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata as md
import os
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import methods as exp_methods
from experiments.lib import models as exp_models
from experiments.lib.bench import machine, states, timing
from experiments.lib.bench import models as bench_models
from experiments.lib.bench.common import random_prompts
from experiments.lib.bench.floors import (cell_bandwidth, decode_flops, floors, peer_cache_bytes, prefill_flops,
                                          weight_bytes_per_step)
from experiments.lib.bench.peer_hf import HFRunner, greedy_parity, hf_model
from experiments.lib.bench.throughput import StateStepper, make_runner
from experiments.lib.perplexity import text_windows
from specache_jax.caches.budget import device_bytes_at
from specache_jax.data import corpora
from specache_jax.errors import ConfigError
from specache_jax.model import decoder


def _error_reason(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


# ------------------------------------------------------------------------------------------------ the timing
def _rotated(labels: list[str], i: int) -> list[str]:
  k = i % len(labels)
  return labels[k:] + labels[:k]


def time_cell(runners: dict, prefill_rounds: int, warmup: int, steps: int, rounds: int,
              log: Callable[[str], None] = print, probe: Callable[[], Any] | None = None) -> dict[str, dict]:
  """Interleaved prefills, then interleaved decode rounds. A runner that fails is recorded as skipped.
  probe: called once per decode round after its methods (the cell's bandwidth measurement)."""
  labels, out = list(runners), {}
  pre = {label: [] for label in labels}
  dec = {label: [] for label in labels}

  def attempt(label, fn):
    try:
      return fn()
    except Exception as e:  # one method that cannot run (memory) must not sink the others
      out[label] = {"skipped": f"while timing: {_error_reason(e)}"}
      log(f"{label}: {out[label]['skipped']}")
      labels.remove(label)
      return None

  for i in range(prefill_rounds):
    for label in _rotated(labels, i):
      sec = attempt(label, runners[label].prefill)
      if sec is not None:
        pre[label].append(sec)
        log(f"{label}: prefill {sec:.2f} s")
  for label in list(labels):
    if warmup:
      t0 = time.perf_counter()
      attempt(label, lambda: runners[label].chain(warmup))
      runners[label].record["warmup_s"] = time.perf_counter() - t0      # the first decode steps compile
      log(f"{label}: {warmup} warm-up steps (incl. compiling) {runners[label].record['warmup_s']:.1f} s")
  for i in range(rounds):
    for label in _rotated(labels, i) if labels else []:
      sec = attempt(label, lambda: runners[label].chain(steps))
      if sec is not None:
        dec[label].append(sec)
    if probe is not None:
      probe()
  for label in labels:
    rec = runners[label].finish()
    rec.update(prefill_s=statistics.median(pre[label]), rounds_prefill_s=pre[label],
               step_s=statistics.median(dec[label]), rounds_step_s=dec[label])
    out[label] = rec
  return out


def _ratios(cell: dict, reference: str) -> None:
  ref = cell["methods"].get(reference, {})
  for rec in cell["methods"].values():
    if "step_s" not in rec:
      continue
    rec["decode_speed_vs_ref"] = timing.ratio(rec["tokens_per_s"], ref.get("tokens_per_s"))
    rec["prefill_time_vs_ref"] = timing.ratio(rec["prefill_s"], ref.get("prefill_s"))


def cell_prompts(config, model, context: int, batch: int, prompt_len: int):
  """A cell's prompts: seeded random tokens (`prompts="random"`), or `batch` consecutive windows of a corpus's text
  (`prompts=<corpus>`: what a speculative method meets in use: its guesses hit as often as on real text)."""
  prompts = config.get("prompts", "random")
  if prompts == "random":
    return random_prompts(config.seed + context, batch, prompt_len, model.config.vocab_size)
  if prompts not in corpora.LONG_TEXTS:
    raise ConfigError(f"prompts={prompts!r} must be 'random' or a corpus: one of {sorted(corpora.LONG_TEXTS)}")
  if model.tokenizer is None:
    raise ConfigError(f"prompts={prompts!r} needs the checkpoint's tokenizer; model {model.config.name!r} has none "
                      "(random:<shape> models take prompts='random')")
  tokens = text_windows(model.tokenizer, prompts, batch, prompt_len)
  return tokens, np.full((batch,), prompt_len, np.int32)


def run_cell(config, model, hf, limits: dict, context: int, batch: int, log) -> dict:
  cfg, dtype = model.config, model.params["embed"].dtype
  prompt_len = context - config.margin
  tokens, lengths = cell_prompts(config, model, context, batch, prompt_len)
  slots = states.cell_slots(prompt_len, config.warmup + config.rounds * config.steps + 1)
  cell = {"context": context, "batch": batch, "prompt_len": prompt_len, "slots": slots, "methods": {}}
  runners, wbytes, item = {}, weight_bytes_per_step(cfg, model.params), jnp.dtype(dtype).itemsize
  cache_bytes, widths = {}, {}
  for label in exp_methods.labels(config):
    try:
      method = exp_methods.build(config, label, cfg, slots, dtype)
      cache_bytes[label] = device_bytes_at(method, cfg, context, dtype, batch)
      widths[label] = method.speculation.width
      t0 = time.perf_counter()
      runners[label] = make_runner(model, method, tokens, lengths, slots)
      runners[label].record.update(method=exp_methods.describe(method), setup_s=time.perf_counter() - t0)
      log(f"S={context} B={batch} {label}: set up in {runners[label].record['setup_s']:.1f} s")
    except Exception as e:  # a method that cannot run here (memory, settings) is recorded, not fatal
      cell["methods"][label] = {"skipped": _error_reason(e)}
  for label in _labels(config.run_peers):
    spec = dict(_as_dict(config.peers)[label])
    cache_bytes[label] = peer_cache_bytes(spec, cfg, context, batch, item)
    runners[label] = HFRunner(hf, spec, tokens, lengths)
  bw_samples = []
  probe = lambda: bw_samples.append(cell_bandwidth(config, limits))  # noqa: E731
  cell["methods"].update(time_cell(runners, config.prefill_rounds, config.warmup, config.steps, config.rounds, log,
                                   probe))
  del runners
  if bw_samples:
    cell["read_bandwidth"] = {"median_Bps": statistics.median(bw_samples), "samples_Bps": bw_samples}
  order = exp_methods.labels(config) + _labels(config.run_peers)
  cell["methods"] = {label: cell["methods"][label] for label in order}
  flops = prefill_flops(cfg, batch, prompt_len)
  for label, rec in cell["methods"].items():
    if "step_s" in rec:
      rec["tokens_per_s"] = batch / rec["step_s"]
      rec["cache_bytes_per_step"] = int(cache_bytes[label])
      rec["weight_bytes_per_step"] = wbytes
      floors(rec, wbytes + cache_bytes[label], flops, limits, decode_flops(cfg, batch, context, widths.get(label, 1)),
             cell.get("read_bandwidth", {}).get("median_Bps"))
      log(f"S={context} B={batch} {label}: prefill {rec['prefill_s']:.2f} s, {rec['step_s'] * 1e3:.1f} ms/step "
          f"({rec['x_floor']:.2f}x floor), {rec['tokens_per_s']:.1f} tok/s")
  _ratios(cell, config.reference)
  return cell


# ------------------------------------------------------------------------------------------ the scaling curve
def random_captured(cfg, batch: int, length: int, seed: int, dtype) -> states.Captured:
  """Post-RoPE K/V of `length` tokens drawn at random (a prefilled cache's contents, for timing only)."""
  kk, kv = jax.random.split(jax.random.key(seed))
  shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
  return states.Captured(k=jax.random.normal(kk, shape, dtype), v=jax.random.normal(kv, shape, dtype),
                         colsum=jnp.zeros((cfg.n_layers, batch, cfg.n_kv_heads, length), jnp.float32))


def scaling(config, limits: dict, deadline: float, log) -> dict:
  """Our decode step time vs context (batch `sc.batch`) on random weights of `sc.model`'s shape; the methods
  `sc.run_methods` from `config.methods`."""
  sc = config.scaling
  model = bench_models.load(sc.model, config.dtype, 0)
  cfg = dataclasses.replace(model.config, max_position=max(int(c) for c in sc.contexts))
  labels = _labels(sc.run_methods)
  dt = model.params["embed"].dtype
  wbytes = weight_bytes_per_step(cfg, model.params)
  layer_params = decoder.unstack_params(model.params, cfg.n_layers)
  points = []
  for context in (int(c) for c in sc.contexts):
    point = {"context": context, "batch": sc.batch, "methods": {}}
    points.append(point)
    if time.perf_counter() > deadline:
      point["skipped"] = "out of time (config.max_seconds)"
      continue
    prompt_len = context - sc.margin
    slots = states.cell_slots(prompt_len, sc.warmup + sc.rounds * sc.steps + 1)
    captured = random_captured(cfg, sc.batch, prompt_len, context, dt)
    first = jnp.asarray(np.random.RandomState(context).randint(0, cfg.vocab_size, sc.batch), jnp.int32)
    lens = jnp.full((sc.batch,), prompt_len, jnp.int32)
    steppers = {}
    for label in labels:
      try:
        method = exp_methods.build(config, label, cfg, slots, dt)
        steppers[label] = StateStepper(model.params, layer_params, cfg, method, captured, first, lens, slots)
        point["methods"][label] = {"method": exp_methods.describe(method),
                                   "cache_bytes_per_step": device_bytes_at(method, cfg, context, dt, sc.batch),
                                   "decode_width": method.speculation.width}
        steppers[label].chain(max(sc.warmup, 1))
      except Exception as e:  # memory at long contexts: recorded, the others go on
        steppers.pop(label, None)
        point["methods"][label] = {"skipped": _error_reason(e)}
    del captured
    samples, bw_samples = {label: [] for label in steppers}, []
    for i in range(sc.rounds):
      for label in _rotated(list(steppers), i) if steppers else []:
        samples[label].append(steppers[label].chain(sc.steps))
      if steppers:
        bw_samples.append(cell_bandwidth(config, limits))
    del steppers
    if bw_samples:
      point["read_bandwidth"] = {"median_Bps": statistics.median(bw_samples), "samples_Bps": bw_samples}
    for label, xs in samples.items():
      rec = point["methods"][label]
      rec.update(step_s=statistics.median(xs), rounds_step_s=xs)
      floors(rec, wbytes + rec["cache_bytes_per_step"], 0.0, limits,
             decode_flops(cfg, sc.batch, context, rec["decode_width"]),
             point.get("read_bandwidth", {}).get("median_Bps"))
      log(f"scaling S={context} {label}: {rec['step_s'] * 1e3:.1f} ms/step ({rec['x_floor']:.2f}x floor)")
  return {"model": str(getattr(model, "source", sc.model)), "shape": sc.model, "batch": sc.batch, "weight_bytes_per_step": wbytes,
          "warmup": sc.warmup, "steps": sc.steps, "rounds": sc.rounds, "points": points}


# ------------------------------------------------------------------------------------------------- the sweep
def _as_dict(x) -> dict:
  return dict(x.to_dict() if hasattr(x, "to_dict") else x)


def _labels(text: str) -> list[str]:
  return [s.strip() for s in str(text).split(",") if s.strip()]


def set_threads(requested: int) -> dict:
  """torch gets as many threads as the cores JAX's CPU backend uses (or `requested`); both recorded."""
  import torch
  n = int(requested) or machine.cpu_threads()
  torch.set_num_threads(n)
  return {"jax_cpu_threads": machine.cpu_threads(), "torch_threads": torch.get_num_threads()}


def versions() -> dict:
  out = {}
  for name in ("torch", "transformers", "optimum-quanto", "accelerate", "jax", "jaxlib"):
    try:
      out[name] = md.version(name)
    except md.PackageNotFoundError:
      out[name] = None
  return out


def load_model(name: str, dtype: str, seed: int):
  """`random:<shape>` (lib/bench/models.py), else the experiments' loader (whose `.source` is the checkpoint file)."""
  if name.startswith(bench_models.RANDOM_PREFIX):
    return bench_models.load(name, dtype, seed)
  return exp_models.load(name, dtype)


def run(config, log: Callable[[str], None] = print, progress: Callable[[dict], None] | None = None) -> dict:
  """Everything: machine limits, greedy parity, the interleaved table, the scaling curve -> a JSON-ready dict.
  `progress(result)` is called after each finished cell (e.g. to save a partial result)."""
  progress = progress or (lambda r: None)
  t_start = time.perf_counter()
  deadline = t_start + float(config.max_seconds)
  threads = set_threads(config.threads)
  model = load_model(config.model, config.dtype, config.seed)
  hf = hf_model(model, config.hf_weights, config.hf_attn, config.hf_device, str(getattr(model, "source", "")))
  log(f"threads {threads}; measuring the machine")
  limits = machine.measure(int(config.machine.bandwidth_bytes), int(config.machine.gemm_n),
                           threads["jax_cpu_threads"], config.hf_device, int(config.machine.repeats))
  limits.update(threads)
  meta = {"benchmark": "peer", "model": config.model, "model_source": str(getattr(model, "source", "")),
          "dtype": str(model.params["embed"].dtype), "hf_weights": config.hf_weights, "hf_attn": config.hf_attn,
          "hf_device": config.hf_device, "versions": versions(), "machine_start": timing.machine_info(),
          "thread_env": {k: os.environ.get(k, "") for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")},
          "limits": limits, "prefill_rounds": config.prefill_rounds, "warmup": config.warmup,
          "prompts": config.get("prompts", "random"),
          "decode_steps": config.steps, "rounds": config.rounds, "reference": config.reference,
          "methods": {label: exp_methods.spec_of(config, label) for label in exp_methods.labels(config)},
          "peers": {label: dict(_as_dict(config.peers)[label]) for label in _labels(config.run_peers)}}
  p = config.parity
  result = {"meta": meta, "parity": greedy_parity(model, hf, config.seed + 1, p.batch, p.prompt_len, p.new_tokens)}
  log(f"greedy parity: {result['parity']['equal']}/{result['parity']['total']} tokens equal")
  cells = result["cells"] = []
  for context in (int(c) for c in config.contexts):
    for batch in (int(b) for b in config.batches):
      if time.perf_counter() > deadline:
        cells.append({"context": context, "batch": batch, "skipped": "out of time (config.max_seconds)"})
        continue
      cells.append(run_cell(config, model, hf, limits, context, batch, log))
      progress(result)
  del hf
  if config.scaling.enabled:
    result["scaling"] = scaling(config, limits, deadline, log)
  result["targets"] = targets(result, config.targets)
  meta["machine_end"] = timing.machine_info()
  meta["seconds"] = time.perf_counter() - t_start
  return result


def merge(results: list[dict], targets_config) -> dict:
  """Several runs' results as one (e.g. a grid split so that one process never holds every method's cache at
  the largest cell): cells sorted by (context, batch), a later run's cell replacing an earlier one's; the first
  run's machine limits and parity; the scaling curve of the last run that has one; targets recomputed.
  meta["merged_runs"] records each run's command, cells, limits and load, for the report; a result that is itself
  a merge contributes its own runs (so a committed report can take a new run's cells)."""
  if not results:
    raise ValueError("merge needs at least one result")
  meta = dict(results[0]["meta"])
  meta["methods"], meta["peers"] = {}, {}
  cells, runs = {}, []
  for r in results:
    m = r["meta"]
    meta["methods"].update(m["methods"])
    meta["peers"].update(m["peers"])
    done = [c for c in r["cells"] if "methods" in c]
    for c in done:
      cells[(c["context"], c["batch"])] = c
    if "merged_runs" in m:
      runs.extend(m["merged_runs"])
      continue
    runs.append({"command": m.get("command", ""), "cells": [f"{c['context']}/B{c['batch']}" for c in done],
                 "prefill_rounds": m["prefill_rounds"],
                 "limits": m["limits"], "machine_start": m.get("machine_start", {}),
                 "machine_end": m.get("machine_end", {}), "seconds": m.get("seconds")})
  meta["merged_runs"] = runs
  counts = sorted({r["prefill_rounds"] for r in runs if r["cells"]})
  if len(counts) > 1:                                   # the timing line then names the range (each run: its own)
    meta["prefill_rounds"] = f"{counts[0]}–{counts[-1]}"

  meta["seconds"] = sum(r["seconds"] or 0 for r in runs)
  meta["machine_end"] = results[-1]["meta"].get("machine_end", {})
  merged = {"meta": meta, "parity": results[0]["parity"], "cells": [cells[k] for k in sorted(cells)]}
  curves = [r["scaling"] for r in results if r.get("scaling")]
  if curves:
    merged["scaling"] = curves[-1]
  merged["targets"] = targets(merged, targets_config)
  return merged


# ---------------------------------------------------------------------------------------- targets and report
def targets(result: dict, t) -> list[dict]:
  """Issue 10's "done when" rules, checked on this run's medians (None where a cell is missing)."""
  ref, long_, short = result["meta"]["reference"], int(t.context), int(t.short_context)
  cells = {(c["context"], c["batch"]): c["methods"] for c in result["cells"] if "methods" in c}
  batches = sorted({b for _, b in cells})
  get = lambda s, b, label, key: cells.get((s, b), {}).get(label, {}).get(key)

  def rule(text, values, ok):
    known = [v for v in values.values() if v is not None]
    met = None if len(known) < len(values) or not values else all(ok(v) for v in known)
    return {"rule": text, "values": values, "met": met}

  contexts = [int(c) for c in t.contexts]
  out = [rule(f"{t.full} decode tok/s >= 1.0x {ref} at {contexts}, every batch",
              {f"{s}/B{b}": get(s, b, t.full, "decode_speed_vs_ref") for s in contexts for b in batches},
              lambda v: v >= 1.0),
         rule(f"{t.full} prefill time <= 1.0x {ref}'s at {contexts}",
              {f"{s}/B{b}": get(s, b, t.full, "prefill_time_vs_ref") for s in contexts for b in batches},
              lambda v: v <= 1.0)]
  spec1 = _labels(t.spec1)
  out.append(rule(f"{', '.join(spec1)} decode tok/s >= {t.spec1_min}x {ref} at {long_}",
                  {f"{l}/B{b}": get(long_, b, l, "decode_speed_vs_ref") for l in spec1 for b in batches},
                  lambda v: v >= t.spec1_min))
  vals = {}
  for l in spec1:
    for b in batches:
      a, f = get(long_, b, l, "step_s"), get(short, b, t.full, "step_s")
      vals[f"{l}/B{b}"] = timing.ratio(a, f)
  out.append(rule(f"{', '.join(spec1)} step at {long_} <= {t.spec1_vs_full_short}x {t.full}'s step at {short}",
                  vals, lambda v: v <= t.spec1_vs_full_short))
  fast = _labels(t.fast)
  out.append(rule(f"{', '.join(fast)} decode tok/s >= {t.fast_min}x {ref} at {long_}",
                  {f"{l}/B{b}": get(long_, b, l, "decode_speed_vs_ref") for l in fast for b in batches},
                  lambda v: v >= t.fast_min))
  ours = list(result["meta"]["methods"])
  out.append(rule(f"every method of ours within {t.floor_max}x of its bandwidth floor at {long_}",
                  {f"{l}/B{b}": get(long_, b, l, "x_floor") for l in ours for b in batches},
                  lambda v: v <= t.floor_max))
  return out
