"""Hit rates of SpeCache's speculation over a long generation, per layer, and the anatomy of its misses.

- exact-token hit rate: how often the speculative token T'_{t+1} equals the real next token T_{t+1};
- top-k hit rate: |κ_t ∩ exact top-k of the real token's 16-bit attention| / k, per layer (SpeCache's
  `track_hits=True` computes the exact top-k alongside, in simulated mode);
- unfetched mass: the real token's exact attention on the positions the step read in low bits only;
- query drift: 1 - cosine between the real query and the speculative query that chose κ_t;
each split by whether the speculative token that chose κ_t was right (hit) or wrong (miss), per layer.
Prompts are windows of a long text; generation is greedy with no stop token, so every row decodes
`max_new_tokens` tokens. One cell per method; a restarted run skips finished methods.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from experiments.lib import methods, models, report
from experiments.lib.perplexity import text_windows
from experiments.lib.store import ResultStore, SweepResult, atomic_write_text, fingerprint
import specache_jax as sj


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


def _pair(r, key):
  show = lambda x: "–" if x is None else f"{x:.3f}"
  return f"{show(r.get(f'{key}_on_hit'))} / {show(r.get(f'{key}_on_miss'))}"


def write_outputs(config, store, labels, command, seconds) -> str:
  out_dir = pathlib.Path(config.output_dir)
  recs = [store.cells[label] for label in labels if label in store.cells]
  rows = []
  for r in recs:
    per_layer = r.get("topk_hit_rate_per_layer", [])
    exact = r.get("exact_hit_rate")                                 # none without a speculative row
    rows.append([r["method"], "–" if exact is None else f"{exact:.3f}", f"{r['topk_hit_rate']:.3f}",
                 f"{min(per_layer):.3f}" if per_layer else "–", _pair(r, "topk_hit_rate"),
                 _pair(r, "unfetched_mass"), _pair(r, "drift"),
                 f"{r['sync_fetch_rate']:.3f}" if "sync_fetch_rate" in r else "0", r["tokens"], f"{r['seconds']:.0f}"])
  table = report.md_table(["method", "exact-token hit", "top-k hit (mean)", "top-k hit (worst layer)",
                           "top-k hit (after hit / miss)", "unfetched mass (after hit / miss)",
                           "query drift (after hit / miss)", "sync fetches", "decoded tokens", "seconds"], rows)
  notes = [f"Model `{config.model}`; {config.num_prompts} prompt(s) of {config.context_tokens} tokens of "
           f"`{config.corpus}`; {config.max_new_tokens} greedy tokens each (no stop token).",
           "Exact-token hit: the speculative token (with several candidates: one of them) equals the real next "
           "token. Top-k hit: the share of the real token's exact top-k positions (16-bit attention, averaged "
           "over each GQA group) that the speculative fetch set κ contained, averaged over steps, rows, KV heads "
           "(per layer in hitrate.png).",
           "Unfetched mass: the real token's exact attention on the positions its step read low-bit only (below "
           "the 16-bit ring, not in κ). Query drift: 1 - cosine between the real query and the speculative "
           "query that chose κ (same position). 'after hit / miss': steps whose κ was chosen by a right / "
           "wrong speculative token. Sync fetches: the share of (layer, KV head) fetches made on the critical "
           "path (exact_on_miss, non-speculative).",
           f"Wall time of this invocation: {seconds:.0f} s."]
  atomic_write_text(out_dir / "summary.md", report.header("SpeCache hit rates and misses", command, notes) + "\n"
                    + table + "\n")
  plt = report.pyplot()
  panels = (("topk_hit_rate", "top-k hit rate"), ("unfetched_mass", "unfetched attention mass"),
            ("drift", "query drift (1 - cos)"))
  rows = -(-len(recs) // 4)                             # legend rows under the panels, 4 methods each
  fig, axes = plt.subplots(1, 3, figsize=(15, 4 + 0.25 * rows))
  colors = plt.get_cmap("tab20" if len(recs) > 10 else "tab10")
  for ax, (key, title) in zip(axes, panels):
    for i, r in enumerate(recs):
      for part, style in (("on_hit", "-"), ("on_miss", "--")):
        ys = r.get(f"{key}_{part}_per_layer", [])
        if ys:
          ax.plot(range(len(ys)), ys, style, color=colors(i), marker="o", ms=2,
                  label=r["method"] if ax is axes[0] and part == "on_hit" else None)
    ax.set_xlabel("layer")
    ax.set_title(title)
  axes[0].set_ylim(0, 1.02)
  axes[0].plot([], [], "k-", label="after a right guess")
  axes[0].plot([], [], "k--", label="after a wrong guess")
  fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.06 * rows + 0.02, 1, 1))
  fig.savefig(out_dir / "hitrate.png", dpi=120)
  plt.close(fig)
  return table
