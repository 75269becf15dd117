"""SpeCache's κ selection on this CPU: one `lax.top_k` over all S slots vs the blocked exact top-k
(`selection.top_k_indices`: top-k per block, then top-k of the candidates).

  python -m experiments.topk_bench --config=configs/topk_bench.py          # results/topk_cpu.{json,md}
  python -m experiments.topk_bench --config=configs/topk_bench.py:smoke --config.out=/tmp/t

Shapes: scores [B, K=3, S] float32 (SmolLM2's KV heads), k = 64 (the paper's). Each variant is jitted over
`config.layers` independent score arrays (one program, like a decode step's layers); time per layer = call / layers,
median over rounds, variants interleaved round by round. Before timing, every blocked variant's indices are
checked equal to lax.top_k's.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.bench import timing
from experiments.lib.store import atomic_write_json, atomic_write_text
from specache_jax.caches.selection import TOPK_BLOCK, top_k_indices

N_KV = 3


def _variants(k: int, blocks):
  out = {"lax.top_k": lambda xs: [jax.lax.top_k(x, k)[1] for x in xs]}
  for blk in blocks:
    out[f"blocked {blk}"] = lambda xs, blk=blk: [top_k_indices(x, k, blk) for x in xs]
  return out


def _cell(b: int, s: int, k: int, blocks, layers: int, rounds: int) -> dict:
  rng = np.random.default_rng(s + b)
  xs = [jnp.asarray(rng.standard_normal((b, N_KV, s)), jnp.float32) for _ in range(layers)]
  fns = {name: jax.jit(fn) for name, fn in _variants(k, blocks).items()}
  want = [np.asarray(a) for a in fns["lax.top_k"](xs)]
  for name, fn in fns.items():
    if any(not np.array_equal(np.asarray(g), w) for g, w in zip(fn(xs), want)):
      raise AssertionError(f"{name} differs from lax.top_k at B={b} S={s}")
  samples = {name: [] for name in fns}
  for r in range(rounds):
    names = list(fns)
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      timing.block(fns[name](xs))
      samples[name].append((time.perf_counter() - t0) / layers)
  return {name: {"ms_per_layer": statistics.median(v) * 1e3, "samples_ms": [round(x * 1e3, 4) for x in v]}
          for name, v in samples.items()}


def _markdown(rep: dict) -> str:
  cells = rep["cells"]
  names = list(cells[0]["variants"])
  head = ["| variant | " + " | ".join(f"S={c['S']} B={c['B']}" for c in cells) + " |",
          "|---|" + "---|" * len(cells)]
  rows = []
  for name in names:
    base = [c["variants"]["lax.top_k"]["ms_per_layer"] for c in cells]
    vals = [c["variants"][name]["ms_per_layer"] for c in cells]
    rows.append(f"| {name} | " + " | ".join(f"{v:.3f} ({b / v:.1f}×)" for v, b in zip(vals, base)) + " |")
  m = rep["meta"]
  return "\n".join([
      "# κ selection: lax.top_k vs the blocked exact top-k (selection.top_k_indices) on this CPU", "",
      f"Command: `{m['command']}`", "",
      f"- machine: {m['machine']}; load average at start {m['load_start']}, at end {m['load_end']}",
      f"- scores [B, {N_KV}, S] float32, k = {m['k']}, {m['layers']} layers per program; ms per layer, median "
      f"of {m['rounds']} interleaved rounds (speed-up vs lax.top_k); every variant's indices equal lax.top_k's",
      f"- the library's block (`selection.TOPK_BLOCK`): {TOPK_BLOCK}", "",
      *head, *rows, ""])


def run(config, command: str) -> dict:
  """Every (B, S) cell of `config` (configs/topk_bench.py); writes <config.out>.json and .md, returns the report."""
  rep = {"meta": {"command": command, "machine": timing.machine_info(), "load_start": timing.load_average(),
                  "k": config.k, "layers": config.layers, "rounds": config.rounds}, "cells": []}
  for b in config.batches:
    for s in config.sizes:
      rep["cells"].append({"B": b, "S": s, "variants": _cell(b, s, config.k, config.blocks, config.layers,
                                                             config.rounds)})
      print(f"B={b} S={s}: " + ", ".join(f"{n} {v['ms_per_layer']:.3f} ms"
                                          for n, v in rep["cells"][-1]["variants"].items()))
  rep["meta"]["load_end"] = timing.load_average()
  atomic_write_json(config.out + ".json", rep)
  atomic_write_text(config.out + ".md", _markdown(rep))
  return rep
