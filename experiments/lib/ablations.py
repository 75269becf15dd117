"""SpeCache ablations on NIAH cells and on perplexity, in one table.

The variants are ordinary entries of `config.methods` (prefetch budget k, bits b, group size g, residual length
R, the 1-bit quantizer, speculative vs non-speculative fetch, pre-decoding on or off; plus references). This module runs the NIAH sweep
(`experiments.lib.niah`) and the perplexity sweep (`experiments.lib.perplexity`) over them, each resumable in
its own sub-folder of `config.output_dir`, and joins their results into `summary.md` / `results.json`.
"""
from __future__ import annotations

import math
import pathlib
import time

import ml_collections

from experiments.lib import methods, models, niah, perplexity, report
from experiments.lib.store import SweepResult, atomic_write_json, atomic_write_text

PARTS = ("niah", "perplexity")


def part_config(config, part: str) -> ml_collections.ConfigDict:
  """The sub-sweep's own config: the shared fields plus `config.<part>`."""
  c = ml_collections.ConfigDict(config[part].to_dict())
  for field in ("model", "dtype", "methods", "run_methods", "extra_methods"):
    c[field] = config[field]
  c.output_dir = str(pathlib.Path(config.output_dir) / part)
  c.stop_after = config.stop_after
  return c


def run(config, model=None, command: str = "python -m experiments.ablations --config=configs/ablations.py",
        log=print) -> SweepResult:
  start = time.time()
  parts = [p.strip() for p in config.run_parts.split(",") if p.strip()]
  bad = [p for p in parts if p not in PARTS]
  if bad or not parts:
    raise ValueError(f"run_parts={config.run_parts!r} must name some of {PARTS}")
  labels = methods.labels(config)
  model = model or models.load(config.model, config.dtype)
  results, computed, skipped = {}, 0, 0
  for part in parts:
    sub = part_config(config, part)
    if config.stop_after and computed >= config.stop_after:
      break
    sub.stop_after = config.stop_after - computed if config.stop_after else 0
    runner = niah.run if part == "niah" else perplexity.run
    res = runner(sub, model=model, command=command, log=log)
    results[part] = (sub, res)
    computed, skipped = computed + res.computed, skipped + res.skipped
  rows = joined_rows(config, labels, results)
  table = write_outputs(config, labels, rows, command, time.time() - start)
  return SweepResult(table, rows, computed, skipped, time.time() - start)


def joined_rows(config, labels, results) -> dict:
  out = {label: {"settings": methods.spec_of(config, label)} for label in labels}
  if "niah" in results:
    sub, res = results["niah"]
    lengths, depths = niah.grid(sub)
    cells = [(n, d) for n in lengths for d in depths]
    full = {c for c in cells if res.records.get(niah.cell_id("full", *c), {}).get("correct")}
    for label in labels:
      recs = {c: res.records.get(niah.cell_id(label, *c)) for c in cells}
      done = {c: r for c, r in recs.items() if r is not None}
      if len(done) == len(cells):
        out[label]["niah_correct"] = sum(r["correct"] for r in done.values())
        out[label]["niah_cells"] = len(cells)
        out[label]["niah_missed_vs_full"] = [f"{n}@{d:g}" for (n, d) in full if not done[n, d]["correct"]]
        out[label]["device_bytes"] = max(r["device_bytes"] for r in done.values())
  if "perplexity" in results:
    sub, res = results["perplexity"]
    buckets = perplexity.parse_buckets(sub.buckets)
    for label in labels:
      got = perplexity.pooled(res.records, label, sub.num_windows)
      if got is None:
        continue
      sums, recs = got
      out[label]["ppl"] = {b: (math.exp(s / c) if c else None) for b, (s, c) in sums.items()}
      out[label]["ppl_buckets"] = [perplexity.bucket_name(lo, hi) for lo, hi in buckets]
      out[label]["spec_hit_rate"] = recs[0].get("spec_hit_rate")
      out[label].setdefault("device_bytes", recs[0]["device_bytes"])
  return out


def write_outputs(config, labels, rows, command, seconds) -> str:
  out_dir = pathlib.Path(config.output_dir)
  buckets = next((r["ppl_buckets"] for r in rows.values() if "ppl_buckets" in r), [])
  full_ppl = rows.get("full", {}).get("ppl", {})
  table_rows = []
  for label in labels:
    r = rows[label]
    settings = {k: v for k, v in r["settings"].items() if k != "name"}
    what = r["settings"]["name"] + (" " + ", ".join(f"{k}={v}" for k, v in settings.items()) if settings else "")
    niah_cell = (f"{r['niah_correct']}/{r['niah_cells']}" + (f" (misses {', '.join(r['niah_missed_vs_full'])})"
                                                             if r["niah_missed_vs_full"] else "")
                 if "niah_correct" in r else "–")
    ppl_cells = []
    for b in buckets:
      p = r.get("ppl", {}).get(b)
      if p is None:
        ppl_cells.append("–")
      elif label != "full" and full_ppl.get(b):
        ppl_cells.append(f"{p:.3f} ({100 * (p / full_ppl[b] - 1):+.2f}%)")
      else:
        ppl_cells.append(f"{p:.3f}")
    hit = r.get("spec_hit_rate")
    table_rows.append([label, what, niah_cell] + ppl_cells +
                      ["–" if hit is None else f"{hit:.3f}",
                       report.mib(r["device_bytes"]) if "device_bytes" in r else "–"])
  headers = ["variant", "settings", "NIAH found"] + [f"PPL {b}" for b in buckets] + ["spec. token hit",
                                                                                     "device MiB"]
  table = report.md_table(headers, table_rows, align="ll" + "r" * (len(headers) - 2))
  notes = [f"Model `{config.model}`. NIAH: lengths {config.niah.lengths}, depths {config.niah.depths} "
           f"(details in niah/summary.md). Perplexity: `{config.perplexity.corpus}`, "
           f"{config.perplexity.num_windows} window(s) of {config.perplexity.window_tokens} tokens, "
           f"{config.perplexity.prefix_tokens} prefilled, the rest teacher-forced through the cache "
           "(perplexity/summary.md). In parentheses: change vs the 16-bit full cache.",
           f"Wall time of this invocation: {seconds:.0f} s (reused cells are not re-timed)."]
  atomic_write_text(out_dir / "summary.md", report.header("SpeCache ablations", command, notes) + "\n" + table
                    + "\n")
  atomic_write_json(out_dir / "results.json", rows)
  return table
