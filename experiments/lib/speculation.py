"""Issue 14's one ablation table for SpeCache 1-bit's robust-speculation variants, joined from the stores the
experiments wrote (nothing is recomputed):

  hit rates, synchronous fetches   experiments.hitrate      (results/speculation/hitrate/results.json)
  NIAH grid                        experiments.niah         (results/speculation/niah/results.json)
  RULER CPU suite                  experiments.ruler        (results/ruler_robust/results.json)
  offloaded step time              experiments.peer_bench   (configs/peer_bench.py:robust -> steps_*.json, one or
                                                            several runs, each label's ratio to the faithful step
                                                            of its own run)
  perplexity 4k-8k                 experiments.perplexity   (results/speculation/perplexity/results.json, :long)
  device bytes                     the method's state shapes (`budget.device_bytes_at`, bf16, SmolLM2's shape)

and checked against the issue's "done when": device bytes <= 0.12x the full cache's (bf16, 8k), synchronous
fetches <= 10% of layer-steps, >= 90% of the NIAH needles the full cache retrieves, >= 90% of its RULER average,
4k-8k perplexity <= 1.10x the full cache's.
A cell a store does not hold is '–' and its check is not met.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from experiments.lib import methods
from experiments.lib.models import SHAPES
from experiments.lib.store import ResultStore
from specache_jax.caches import cache_config
from specache_jax.caches.budget import device_bytes_at
from specache_jax.model_config import ModelConfig

FULL = "full"
FAITHFUL = "specache_1bit"
AT_MOST = dict(bytes_vs_full=0.12, sync_fetch_rate=0.10, ppl_vs_full=1.10)        # the bar
AT_LEAST = dict(niah_vs_full=0.90, ruler_vs_full=0.90)
LIMITS = {**AT_MOST, **AT_LEAST}
PPL_BUCKET = "4k–8k"


def _cells(path) -> dict[str, dict]:
  """An experiment's result store's cells (none when the file does not exist)."""
  return ResultStore(path).cells


def hitrate_rows(path) -> dict[str, dict]:
  return {c["method"]: c for c in _cells(path).values()}


def niah_rows(path) -> dict[str, dict]:
  """label -> {(needle, length, depth): correct} over the cells the store holds (needle "": the config's own)."""
  out: dict[str, dict] = {}
  for c in _cells(path).values():
    out.setdefault(c["method"], {})[(c.get("needle", ""), c["length"], c["depth"])] = bool(c["correct"])
  return out


def ruler_rows(path) -> dict[str, dict]:
  """label -> {(task, length, sample index): score (0..1)}, the samples RULER's average takes."""
  out: dict[str, dict] = {}
  for c in _cells(path).values():
    out.setdefault(c["method"], {})[(c["task"], c["length"], c["index"])] = float(c["score"])
  return out


def perplexity_rows(path, bucket: str = PPL_BUCKET) -> dict[str, float]:
  """label -> perplexity over `bucket` (experiments.perplexity's bucket name), pooled over the stored windows."""
  sums: dict[str, list[float]] = {}
  for c in _cells(path).values():
    if c.get("count", {}).get(bucket):
      s = sums.setdefault(c["method"], [0.0, 0])
      s[0] += c["nll_sum"][bucket]
      s[1] += c["count"][bucket]
  return {label: math.exp(s / n) for label, (s, n) in sums.items()}


def step_rows(paths) -> dict[str, dict]:
  """label (without `_offload`) -> its cell record (ms per step at the run's one context and batch), with the run it
  came from (`source`) and that run's faithful step (`faithful_s`; None if the run has none). `paths`: one
  peer_bench JSON or several runs; a label takes its first run's cell, and every run must be at one context and
  batch (a column of the table)."""
  out: dict[str, dict] = {}
  shapes = set()
  for path in [paths] if isinstance(paths, (str, pathlib.Path)) else paths:
    path = pathlib.Path(path)
    if not path.exists():
      continue
    cells = [c for c in json.loads(path.read_text())["cells"] if "methods" in c]
    run = {label.removesuffix("_offload"): dict(rec, context=c["context"], batch=c["batch"], source=str(path))
           for c in cells for label, rec in c["methods"].items() if rec.get("step_s")}
    shapes |= {(r["context"], r["batch"]) for r in run.values()}
    faithful_s = run.get(FAITHFUL, {}).get("step_s")
    for label, rec in run.items():
      out.setdefault(label, dict(rec, faithful_s=faithful_s))
  if len(shapes) > 1:
    raise ValueError(f"the offloaded-step runs {paths} are at several (context, batch) cells {sorted(shapes)}; the "
                     "table's step column takes one")
  return out


def device_bytes(spec: dict, context: int = 8192, shape: str = "smollm2-135m") -> int:
  """A label's device bytes (bf16, one row of `context` tokens, the model shape `shape`)."""
  spec = dict(spec)
  return device_bytes_at(cache_config(spec.pop("name"), **spec), ModelConfig(**SHAPES[shape], name=shape), context,
                         jnp.bfloat16)


def table(hitrate_path, niah_path, ruler_path, steps_path, perplexity_path) -> tuple[list[dict], str]:
  """(rows, markdown) for every SpeCache 1-bit label some store holds, the faithful one first. steps_path: one
  peer_bench JSON or a sequence of them (`step_rows`)."""
  specs = dict(methods.standard(), **methods.robust())
  hit, niah, ruler, steps, ppl = (hitrate_rows(hitrate_path), niah_rows(niah_path), ruler_rows(ruler_path),
                                  step_rows(steps_path), perplexity_rows(perplexity_path))
  labels = [l for l in specs if l.startswith(FAITHFUL) and any(l in d for d in (hit, niah, ruler, steps, ppl))]
  full_niah = niah.get(FULL, {})
  full_ruler = float(np.mean(list(ruler[FULL].values()))) if ruler.get(FULL) else None
  full_bytes = device_bytes(specs[FULL])
  rows = []
  for label in labels:
    r: dict[str, Any] = {"label": label, "bytes_vs_full": device_bytes(specs[label]) / full_bytes}
    if label in hit:
      r["exact_hit"] = hit[label].get("exact_hit_rate")
      r["topk_hit"] = hit[label].get("topk_hit_rate")
      r["sync_fetch_rate"] = hit[label].get("sync_fetch_rate", 0.0)     # absent: never on the critical path
    # a ratio to the full cache only over whole grids: every cell the full cache has for each needle the label
    # ran (some labels ran the config's needle only), every RULER sample; a run still going, or one stopped
    # early, is reported as partial, never as its average so far
    if label in niah:
      needles = {k[0] for k in niah[label]}
      grid = [k for k in full_niah if k[0] in needles]
      found = [k for k in grid if full_niah[k]]
      r["niah"] = (sum(niah[label].values()), len(niah[label]))
      if all(k in niah[label] for k in grid):
        r["niah_vs_full"] = sum(niah[label][k] for k in found) / len(found) if found else None
      else:
        r["niah_partial"] = (sum(k in niah[label] for k in grid), len(grid))
    if ruler.get(label):
      want = ruler.get(FULL) or ruler[label]          # no full-cache samples: the label's own, no ratio
      if all(k in ruler[label] for k in want):
        mine = float(np.mean([ruler[label][k] for k in want]))
        r["ruler"] = 100 * mine
        r["ruler_vs_full"] = mine / full_ruler if full_ruler else None
      else:
        r["ruler_partial"] = (sum(k in ruler[label] for k in want), len(want))
    if label in ppl:
      r["ppl"] = ppl[label]
      r["ppl_vs_full"] = ppl[label] / ppl[FULL] if FULL in ppl else None
    if label in steps:
      base_step = steps[label]["faithful_s"]
      r["step_ms"] = 1e3 * steps[label]["step_s"]
      r["step_vs_faithful"] = steps[label]["step_s"] / base_step if base_step else None
      r["step_source"] = steps[label]["source"]
    r["meets"] = (all(r.get(k) is not None and r[k] <= v for k, v in AT_MOST.items())
                  and all(r.get(k) is not None and r[k] >= v for k, v in AT_LEAST.items()))
    rows.append(r)
  return rows, _markdown(rows, niah.get(FULL), full_ruler, ppl.get(FULL), steps.get(FULL), steps.get(FAITHFUL))


def _step_sources(rows) -> str:
  """Which run each row's offloaded step comes from, where they come from more than one."""
  runs: dict[str, list[str]] = {}
  for r in rows:
    if "step_source" in r:
      runs.setdefault(r["step_source"], []).append(r["label"])
  if len(runs) < 2:
    return ""
  return (" Offloaded steps from several runs (each × its own run's faithful step): " +
          "; ".join(f"`{src}`: {', '.join(labels)}" for src, labels in runs.items()) + ".")


def _fmt(v, spec: str) -> str:
  return "–" if v is None else format(v, spec)


def _partial(r: dict, name: str) -> str:
  """'partial (n/N of full's cells)' where a label's cells do not yet cover the full cache's, else ''."""
  got = r.get(f"{name}_partial")
  return f"partial ({got[0]}/{got[1]} of full's cells)" if got else ""


COLUMNS = ("SpeCache 1-bit", "device bytes × full (bf16, 8k)", "exact-token hit", "top-k hit",
           "sync fetches (layer, KV head)", "NIAH found", "NIAH × full's", "RULER avg", "RULER × full's",
           f"PPL {PPL_BUCKET}", "PPL × full's",
           "offloaded step ms ({context}, B={batch})", "× faithful", "meets the issue's bar")


def _markdown(rows, full_niah, full_ruler, full_ppl, full_step, faithful_step) -> str:
  ctx = faithful_step or full_step or {}
  head = "| " + " | ".join(COLUMNS).format(context=ctx.get("context", "–"), batch=ctx.get("batch", "–")) + " |"
  lines = [head, "|" + "---|" * len(COLUMNS)]
  for r in rows:
    cells = [r["label"], f"{r['bytes_vs_full']:.3f}", _fmt(r.get("exact_hit"), ".3f"), _fmt(r.get("topk_hit"), ".3f"),
             _fmt(r.get("sync_fetch_rate"), ".1%"), f"{r['niah'][0]}/{r['niah'][1]}" if "niah" in r else "–",
             _partial(r, "niah") or _fmt(r.get("niah_vs_full"), ".0%"),
             _partial(r, "ruler") or _fmt(r.get("ruler"), ".1f"), _fmt(r.get("ruler_vs_full"), ".0%"),
             _fmt(r.get("ppl"), ".2f"), _fmt(r.get("ppl_vs_full"), ".2f"),
             _fmt(r.get("step_ms"), ".1f"), _fmt(r.get("step_vs_faithful"), ".2f"), "yes" if r["meets"] else "no"]
    lines.append("| " + " | ".join(cells) + " |")
  ref = [f"full cache: NIAH {sum(full_niah.values())}/{len(full_niah)}" if full_niah else "full cache: NIAH –",
         f"RULER {_fmt(full_ruler and 100 * full_ruler, '.1f')}",
         f"perplexity {PPL_BUCKET} {_fmt(full_ppl, '.2f')}",
         f"full-cache step {_fmt(full_step and 1e3 * full_step['step_s'], '.1f')} ms"]
  bar = ("The bar (issue 14): device bytes ≤ {bytes_vs_full}× full, synchronous fetches ≤ {sync_fetch_rate:.0%} of "
         "layer-steps (here: of (layer, KV head) fetches), NIAH ≥ {niah_vs_full:.0%} and RULER ≥ {ruler_vs_full:.0%} "
         "of the full cache's, perplexity over positions {bucket} ≤ {ppl_vs_full:.2f}× the full cache's.").format(
             bucket=PPL_BUCKET, **LIMITS)
  return "\n".join(lines) + "\n\n" + "; ".join(ref) + ". " + bar + _step_sources(rows) + "\n"
