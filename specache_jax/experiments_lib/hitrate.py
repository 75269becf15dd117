"""Hit rates of SpeCache's speculation over a long generation, per layer.

- exact-token hit rate: how often the speculative token T'_{t+1} equals the real next token T_{t+1};
- top-k hit rate: |κ_t ∩ exact top-k of the real token's 16-bit attention| / k, per layer (SpeCache's
  `track_hits=True` computes the exact top-k alongside, in simulated mode).
Prompts are windows of a long text; generation is greedy with no stop token, so every row decodes
`max_new_tokens` tokens. One cell per method; a restarted run skips finished methods.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

import specache_jax as sj
from specache_jax.experiments_lib import methods, models, report
from specache_jax.experiments_lib.perplexity import text_windows
from specache_jax.experiments_lib.store import ResultStore, SweepResult, atomic_write_text, fingerprint


def run(config, model=None, command: str = "python -m experiments.hitrate --config=configs/hitrate.py",
        log=print) -> SweepResult:
  start = time.time()
  model = model or models.load(config.model, config.dtype)
  dtype = model.params["embed"].dtype
  prompts = text_windows(model.tokenizer, config.corpus, config.num_prompts, config.context_tokens)
  out_dir = pathlib.Path(config.output_dir)
  store = ResultStore(out_dir / "results.json", meta={"experiment": "hitrate", "command": command})
  labels = methods.labels(config)
  base_fp = (config.model, config.dtype, config.corpus, config.num_prompts, config.context_tokens,
             config.max_new_tokens)
  computed = skipped = 0
  max_len = config.context_tokens + config.max_new_tokens + 2
  for label in report.progress(labels, desc="hit rate"):
    fp = fingerprint(base_fp, dict(methods.settings_fingerprint_parts(config, label)))
    if store.done(label, fp):
      skipped += 1
      continue
    if config.stop_after and store.computed >= config.stop_after:
      break
    method = methods.build(config, label, model.config, max_len, dtype)
    if method.name != "specache":
      raise ValueError(f"hit rates are SpeCache's: method {label!r} is {method.name!r}")
    method = dataclasses.replace(method, track_hits=True, offload=False)
    t0 = time.time()
    out, stats = sj.generate(model, prompts, max_new_tokens=config.max_new_tokens, cache=method,
                             stop_tokens=(), return_stats=True)
    seconds = time.time() - t0
    rec = dict(method=label, settings=methods.describe(method), seconds=seconds,
               tokens=int(np.asarray(out.num_tokens).sum()), **stats)
    store.put_many({label: rec}, fp)
    computed += 1
    log(f"hit rate {label}: exact {stats.get('exact_hit_rate', float('nan')):.3f}, "
        f"top-k {stats.get('topk_hit_rate', float('nan')):.3f} ({seconds:.1f} s)")
  table = write_outputs(config, store, labels, command, time.time() - start)
  return SweepResult(table, store.cells, computed, skipped, time.time() - start)


def write_outputs(config, store, labels, command, seconds) -> str:
  out_dir = pathlib.Path(config.output_dir)
  recs = [store.cells[label] for label in labels if label in store.cells]
  rows = []
  for r in recs:
    per_layer = r.get("topk_hit_rate_per_layer", [])
    rows.append([r["method"], f"{r['exact_hit_rate']:.3f}", f"{r['topk_hit_rate']:.3f}",
                 f"{min(per_layer):.3f}" if per_layer else "–", f"{max(per_layer):.3f}" if per_layer else "–",
                 r["tokens"], f"{r['seconds']:.0f}"])
  table = report.md_table(["method", "exact-token hit", "top-k hit (mean)", "top-k hit (worst layer)",
                           "top-k hit (best layer)", "decoded tokens", "seconds"], rows)
  notes = [f"Model `{config.model}`; {config.num_prompts} prompt(s) of {config.context_tokens} tokens of "
           f"`{config.corpus}`; {config.max_new_tokens} greedy tokens each (no stop token).",
           "Exact-token hit: the speculative token equals the real next token. Top-k hit: the share of the "
           "real token's exact top-k positions (16-bit attention, averaged over each GQA group) that the "
           "speculative fetch set κ contained, averaged over steps, rows, KV heads (per layer in hitrate.png).",
           f"Wall time of this invocation: {seconds:.0f} s."]
  atomic_write_text(out_dir / "summary.md", report.header("SpeCache hit rates", command, notes) + "\n" + table
                    + "\n")
  plt = report.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  for r in recs:
    per_layer = r.get("topk_hit_rate_per_layer", [])
    ax.plot(range(len(per_layer)), per_layer, marker="o", ms=3, label=f"{r['method']} (top-k)")
  ax.set_xlabel("layer")
  ax.set_ylabel("top-k hit rate")
  ax.set_ylim(0, 1.02)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_dir / "hitrate.png", dpi=120)
  plt.close(fig)
  return table
