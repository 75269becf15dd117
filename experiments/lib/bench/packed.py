"""Low-bit attention over PACKED codes (caches/packed.py) vs the dequantize-everything path, on this CPU.

  python -m experiments.packed_bench --config=configs/packed_bench.py          # results/packed_cpu.{json,md}
  python -m experiments.packed_bench --config=configs/packed_bench.py:smoke --config.out=/tmp/p

Shapes: SmolLM2-135M attention (K=3 KV heads, G=3, H=64), T=2 query rows (SpeCache), g=64, float32.
Each variant is jitted over `config.layers` independent layers (one program, layers unrolled, different inputs per
layer, like a decode step) and the time per layer is the call time / layers (wall clock, and the process CPU
time, which the other jobs on a shared machine inflate less); the variants of a cell are interleaved round
by round (rotating order) and the median over rounds is reported, with the load average. Before timing, the
outputs of every packed variant are checked against its float32 reference (max |diff| / max |ref| <= 1e-5).

Variants (per layer):
  baseline_attn    lowbit.dequantized (whole cache -> float32 K and V) + both einsums: today's decode path
  packed_attn      key_logits + value_sum (the defaults)
  baseline_logits  key_logits_reference (dequantize keys + einsum)     key_logits / key_logits_blocked
  baseline_values  value_sum_reference (dequantize values + einsum)    value_sum
"""
from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments.lib.bench import timing
from experiments.lib.store import atomic_write_json, atomic_write_text
from specache_jax.caches import lowbit, packed

_STEP_LAYERS = 30                        # SmolLM2-135M: the projection to one decode step
N_KV, N_REP, HEAD_DIM, T, GROUP = 3, 3, 64, 2, 64
TOL = 1e-5


def _inputs(rng, layers, b, s, bits):
  c = HEAD_DIM * bits // 8
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return dict(
      q=f32(rng.normal(size=(layers, b, T, N_KV, N_REP, HEAD_DIM))),
      p=jax.nn.softmax(f32(rng.normal(0, 2, (layers, b, N_KV, N_REP, T, s))), axis=-1),
      k_codes=jnp.asarray(rng.integers(0, 256, (layers, b, N_KV, s, c)), jnp.uint8),
      k_scale=f32(rng.uniform(0, 1, (layers, b, N_KV, s // GROUP, HEAD_DIM))),
      k_zero=f32(rng.normal(size=(layers, b, N_KV, s // GROUP, HEAD_DIM))),
      v_codes=jnp.asarray(rng.integers(0, 256, (layers, b, N_KV, s, c)), jnp.uint8),
      v_scale=f32(rng.uniform(0, 1, (layers, b, N_KV, s, HEAD_DIM // GROUP))),
      v_zero=f32(rng.normal(size=(layers, b, N_KV, s, HEAD_DIM // GROUP))))


def _variants(bits):
  """name -> per-layer function of the layer's inputs dict."""
  kw = dict(bits=bits, group_size=GROUP)
  keys = lambda f: (lambda x: f(x["q"], x["k_codes"], x["k_scale"], x["k_zero"], **kw))
  values = lambda f: (lambda x: f(x["p"], x["v_codes"], x["v_scale"], x["v_zero"], **kw))

  def baseline_attn(x):
    st = lowbit.LowBit(x["k_codes"], x["k_scale"], x["k_zero"], x["v_codes"], x["v_scale"], x["v_zero"],
                       None, None)
    k_BKSH, v_BKSH = lowbit.dequantized(st, **kw)
    logits = jnp.einsum("btkgh,bksh->bkgts", x["q"], k_BKSH)
    return logits, jnp.einsum("bkgts,bksh->btkgh", x["p"], v_BKSH)

  return {
      "baseline_attn": baseline_attn,
      "packed_attn": lambda x: (keys(packed.key_logits)(x), values(packed.value_sum)(x)),
      "baseline_logits": keys(packed.key_logits_reference),
      "key_logits": keys(packed.key_logits),
      "key_logits_blocked": keys(packed.key_logits_blocked),
      "baseline_values": values(packed.value_sum_reference),
      "value_sum": values(packed.value_sum),
  }


CHECKS = {"packed_attn": "baseline_attn", "key_logits": "baseline_logits",
          "key_logits_blocked": "baseline_logits", "value_sum": "baseline_values"}
BASE = {"baseline_attn": "baseline_attn", "packed_attn": "baseline_attn", "baseline_logits": "baseline_logits",
        "key_logits": "baseline_logits", "key_logits_blocked": "baseline_logits",
        "baseline_values": "baseline_values", "value_sum": "baseline_values"}


def _rel_err(out, ref):
  errs = [float(jnp.max(jnp.abs(o - r)) / jnp.max(jnp.abs(r)))
          for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref))]
  return max(errs)


def run_cell(b, s, bits, layers, rounds, names=(), seed=0):
  """Times the variants (all, or `names` plus the references they are checked against) on one shape."""
  inputs = _inputs(np.random.default_rng(seed), layers, b, s, bits)
  variants = _variants(bits)
  if names:
    wanted = set(names) | {CHECKS[n] for n in names if n in CHECKS} | {BASE[n] for n in names}
    variants = {n: f for n, f in variants.items() if n in wanted}
  programs, outputs = {}, {}
  for name, fn in variants.items():
    step = jax.jit(lambda xs, fn=fn: [fn({k: v[i] for k, v in xs.items()}) for i in range(layers)])
    t0 = time.perf_counter()
    outputs[name] = timing.block(step(inputs))                    # compile + warm-up
    programs[name] = (step, time.perf_counter() - t0)
  errors = {n: _rel_err(outputs[n], outputs[r]) for n, r in CHECKS.items() if n in outputs}
  for name, err in errors.items():
    if err > TOL:
      raise AssertionError(f"{name} differs from {CHECKS[name]}: {err:.2e} > {TOL} at {b=} {s=} {bits=}")
  del outputs
  wall = {name: [] for name in programs}
  cpu = {name: [] for name in programs}
  order = list(programs)
  for r in range(rounds):
    for name in order[r % len(order):] + order[:r % len(order)]:
      c0 = time.process_time()
      dt, _ = timing.timed(lambda: programs[name][0](inputs))
      wall[name].append(dt / layers)
      cpu[name].append((time.process_time() - c0) / layers)
  del inputs
  out = {}
  for name, xs in wall.items():
    med = statistics.median(xs)
    cpu_med = statistics.median(cpu[name])
    out[name] = {"ms_per_layer": med * 1e3, "min_ms_per_layer": min(xs) * 1e3,
                 "cpu_ms_per_layer": cpu_med * 1e3,
                 "samples_ms_per_layer": [round(x * 1e3, 4) for x in xs],
                 "first_call_s": round(programs[name][1], 2),
                 "speedup_vs_baseline": statistics.median(wall[BASE[name]]) / med,
                 "cpu_speedup_vs_baseline": statistics.median(cpu[BASE[name]]) / cpu_med,
                 "projected_ms_per_step": med * 1e3 * _STEP_LAYERS}
    if name in errors:
      out[name]["max_rel_err_vs_reference"] = errors[name]
  return out


def markdown(report):
  lines = [
      "# Low-bit attention over packed codes (caches/packed.py) on this CPU",
      "",
      f"Command: `{report['command']}`",
      "",
      f"- machine: {report['machine']['cpu_count']} CPUs, jax {report['machine']['jax']}, "
      f"XLA_FLAGS=`{report['machine']['xla_flags']}`; load average (1/5/15 min) at start "
      f"{report['load_start']}, at end {report['load_end']} (other jobs shared the 2 cores: read the ratios, "
      "the absolute times are inflated by the load); wall time "
      f"{report['wall_s']:.0f} s",
      f"- shapes: K={N_KV}, G={N_REP}, H={HEAD_DIM}, T={T}, g={GROUP}, float32; each variant jitted over "
      f"{report['layers']} independent layers (unrolled), ms per layer = call / layers, median of "
      f"{report['rounds']} interleaved rounds; projected step = ms per layer × {_STEP_LAYERS} layers",
      "- speedup: vs `baseline_attn` (lowbit.dequantized + einsums, today's decode path) for `packed_attn`, vs "
      "the dequantizing reference of the same piece otherwise",
      "- every packed variant checked against its float32 reference first (max |diff| / max |ref| <= 1e-5; "
      "the values are in the JSON)",
      "",
  ]
  cells = report["cells"]
  cols = sorted({(c["S"], c["B"]) for c in cells})
  header = ["| variant | " + " | ".join(f"S={s} B={b}" for s, b in cols) + " |", "|---|" + "---|" * len(cols)]

  def table(by, names, fmt):
    rows = []
    for name in names:
      vals = [by.get(col, {}).get(name) for col in cols]
      if any(v is not None for v in vals):
        rows.append(f"| {name} | " + " | ".join("–" if v is None else fmt(v) for v in vals) + " |")
    return header + rows if rows else ["(not measured in this run)"]

  for bits in sorted({c["bits"] for c in cells}):
    by = {(c["S"], c["B"]): c["variants"] for c in cells if c["bits"] == bits}
    names = list(_variants(bits))
    lines += [f"## {bits}-bit: wall ms per call per layer (speedup)", ""]
    lines += table(by, names, lambda v: f"{v['ms_per_layer']:.3f} ({v['speedup_vs_baseline']:.1f}×)")
    lines += ["", f"## {bits}-bit: process CPU ms per layer (speedup), less sensitive to the other jobs' load",
              ""]
    lines += table(by, names, lambda v: f"{v['cpu_ms_per_layer']:.3f} ({v['cpu_speedup_vs_baseline']:.1f}×)")
    lines += ["", f"Projected low-bit attention per decode step ({_STEP_LAYERS} layers, logits + values), "
              "wall ms:", ""]
    lines += table(by, ["baseline_attn", "packed_attn"], lambda v: f"{v['projected_ms_per_step']:.1f}")
    lines.append("")
  macs = {col: 2 * col[1] * N_KV * N_REP * T * col[0] * HEAD_DIM for col in cols}
  lines += [
      "## The arithmetic floor",
      "",
      "Logits and values each take B·K·G·T·S·H float32 multiply-adds; both pieces are bound by them, not by "
      "bytes, once the codes stay packed (the packed codes of a layer at S=8192, 1-bit, are 0.4 MB). At an "
      "optimistic 90 GMAC/s for this machine (2 cores × 16 float32 FMA/cycle × ~2.8 GHz, nothing else "
      "running) the pieces cannot go below:",
      "",
      "| | " + " | ".join(f"S={s} B={b}" for s, b in cols) + " |",
      "|---|" + "---|" * len(cols),
      "| MMAC per layer | " + " | ".join(f"{macs[c] / 1e6:.1f}" for c in cols) + " |",
      "| ms per layer at 90 GMAC/s | " + " | ".join(f"{macs[c] / 90e6:.3f}" for c in cols) + " |",
      f"| ms per {_STEP_LAYERS}-layer step at 90 GMAC/s | "
      + " | ".join(f"{macs[c] * _STEP_LAYERS / 90e6:.1f}" for c in cols) + " |",
      "",
  ]
  return "\n".join(lines)


def render(path: str) -> None:
  """Re-render the markdown of an existing JSON report (written next to it)."""
  with open(path) as f:
    report = json.load(f)
  atomic_write_text(path.removesuffix(".json") + ".md", markdown(report))


def run(config, command: str) -> dict:
  """Every (bits, S, B) cell of `config` (configs/packed_bench.py); writes <config.out>.json and .md."""
  if config.render:
    render(config.render)
    return {}
  logging.info("devices: %s", jax.devices())
  t_start = time.perf_counter()
  report = {"command": command, "machine": timing.machine_info(), "load_start": timing.load_average(),
            "layers": config.layers, "rounds": config.rounds, "cells": []}
  for bits in config.bits:
    for s in config.sizes:
      for b in config.batches:
        names = [v for v in config.variants.split(",") if v]
        cell = run_cell(b, s, bits, config.layers, config.rounds, names)
        report["cells"].append({"bits": bits, "S": s, "B": b, "variants": cell})
        print(f"bits={bits} S={s} B={b} load={timing.load_average()} " + "  ".join(
            f"{n}={v['ms_per_layer']:.3f}ms({v['speedup_vs_baseline']:.1f}x)" for n, v in cell.items()),
            flush=True)
  report["load_end"] = timing.load_average()
  report["wall_s"] = time.perf_counter() - t_start
  atomic_write_json(config.out + ".json", report)
  atomic_write_text(config.out + ".md", markdown(report))
  print(f"written {config.out}.json and .md")
  return report
