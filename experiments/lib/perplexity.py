"""Perplexity by position bucket for each cache method, teacher-forced token by token through the cache.

Windows of `window_tokens` consecutive tokens are cut from a long text (`corpora.long_text`); the first
`prefix_tokens` of each are prefilled, the rest go through the cache one by one (`teacher_forcing`), and the
negative log-likelihoods are pooled per bucket of absolute positions (positions < prefix are not scored).
Cells (one per method × window) are stored as they finish; a restarted run skips finished cells.
"""
from __future__ import annotations

import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import methods, models, report
from experiments.lib.store import ResultStore, SweepResult, atomic_write_text, fingerprint
from experiments.lib.teacher_forcing import max_len_for, teacher_forced_nll
from specache_jax.caches.budget import device_bytes_at
from specache_jax.data import corpora

CURVE_BLOCK = 128  # positions per point of the plotted curve


def parse_buckets(text: str) -> list[tuple[int, int]]:
  """"0-1024,1024-4096" -> [(0, 1024), (1024, 4096)]; half-open [lo, hi)."""
  out = []
  for part in str(text).split(","):
    try:
      lo, hi = (int(x) for x in part.strip().split("-"))
    except ValueError:
      raise ValueError(f"bucket {part!r} in buckets={text!r} must look like 'lo-hi'") from None
    if not 0 <= lo < hi:
      raise ValueError(f"bucket {part!r}: need 0 <= lo < hi")
    out.append((lo, hi))
  return out


def bucket_name(lo: int, hi: int) -> str:
  k = lambda n: f"{n // 1024}k" if n % 1024 == 0 and n else str(n)
  return f"{k(lo)}–{k(hi)}"


def text_windows(tokenizer, corpus: str, num_windows: int, window_tokens: int) -> np.ndarray:
  """[W, T] int32: consecutive non-overlapping windows from the start of the corpus."""
  text = corpora.long_text(corpus)
  need = num_windows * window_tokens
  chars = min(len(text), need * 6)
  while True:
    ids = tokenizer.encode(text[:chars])
    if len(ids) >= need + 1 or chars >= len(text):
      break
    chars = min(len(text), chars * 2)
  if len(ids) < need:
    raise ValueError(f"corpus {corpus!r} has {len(ids)} tokens, fewer than {num_windows=} × {window_tokens=}")
  return np.asarray(ids[:need], np.int32).reshape(num_windows, window_tokens)


def score_cells(nll_WT: np.ndarray, prefix: int, buckets) -> list[dict]:
  """Per window: NLL sums and counts per bucket, and the mean NLL per CURVE_BLOCK positions."""
  out = []
  positions = prefix + np.arange(nll_WT.shape[1])
  for row in nll_WT:
    sums, counts = {}, {}
    for lo, hi in buckets:
      sel = (positions >= lo) & (positions < hi)
      sums[bucket_name(lo, hi)] = float(np.sum(row[sel], dtype=np.float64))
      counts[bucket_name(lo, hi)] = int(sel.sum())
    blocks = positions // CURVE_BLOCK
    curve = [[int(b * CURVE_BLOCK), float(row[blocks == b].mean())] for b in np.unique(blocks)]
    out.append({"nll_sum": sums, "count": counts, "curve": curve})
  return out


def run(config, model=None, command: str = "python -m experiments.perplexity --config=configs/perplexity.py",
        log=print) -> SweepResult:
  start = time.time()
  model = model or models.load(config.model, config.dtype)
  dtype = model.params["embed"].dtype
  buckets = parse_buckets(config.buckets)
  windows = text_windows(model.tokenizer, config.corpus, config.num_windows, config.window_tokens)
  t = windows.shape[1]
  if t > model.config.max_position:
    raise ValueError(f"window_tokens={t} exceeds the model's context {model.config.max_position}")
  out_dir = pathlib.Path(config.output_dir)
  store = ResultStore(out_dir / "results.json", meta={"experiment": "perplexity", "command": command})
  labels = methods.labels(config)
  base_fp = (config.model, config.dtype, config.corpus, config.window_tokens, config.prefix_tokens)
  computed = skipped = 0
  for label in report.progress(labels, desc="perplexity"):
    fp = fingerprint(base_fp, dict(methods.settings_fingerprint_parts(config, label)))
    ids = [f"{label}/w{w}" for w in range(len(windows))]
    todo = [w for w, c in enumerate(ids) if not store.done(c, fp)]
    skipped += len(ids) - len(todo)
    if not todo:
      continue
    if config.stop_after and store.computed >= config.stop_after:
      break
    method = methods.build(config, label, model.config, max_len_for(t), dtype, run_options=("spec_row",))
    t0 = time.time()
    spec_row = methods.options(config, label).get("spec_row", "model")
    nll, hits = teacher_forced_nll(model.params, jnp.asarray(windows[todo]), cfg=model.config, method=method,
                                   prefix=config.prefix_tokens, spec_row=spec_row)
    nll, hits = np.asarray(jax.device_get(nll)), np.asarray(jax.device_get(hits))
    seconds = time.time() - t0
    if not np.all(np.isfinite(nll)):
      raise FloatingPointError(f"method {label}: non-finite NLL in windows {todo}")
    steps = t - config.prefix_tokens - 1
    info = dict(method=label, settings=methods.describe(method), spec_row=spec_row, seconds=seconds,
                device_bytes=device_bytes_at(method, model.config, max_len_for(t), dtype))
    recs = {ids[w]: dict(info, window=w, spec_hit_rate=(float(h) / steps if method.speculation.width > 1 else None),
                         **cell)
            for w, h, cell in zip(todo, hits, score_cells(nll, config.prefix_tokens, buckets))}
    store.put_many(recs, fp)
    computed += len(recs)
    log(f"perplexity {label}: {len(todo)} window(s) of {t} tokens in {seconds:.1f} s")
  table = write_outputs(config, store, labels, buckets, command, time.time() - start)
  return SweepResult(table, store.cells, computed, skipped, time.time() - start)


def pooled(cells: dict, label: str, n_windows: int):
  """({bucket: (nll_sum, count)}, records) over the stored windows of a method; None if one is missing."""
  recs = [cells.get(f"{label}/w{w}") for w in range(n_windows)]
  if any(r is None for r in recs):
    return None
  out = {}
  for r in recs:
    for b, s in r["nll_sum"].items():
      s0, c0 = out.get(b, (0.0, 0))
      out[b] = (s0 + s, c0 + r["count"][b])
  return out, recs


def table_rows(store: ResultStore, labels, buckets, n_windows: int):
  names = [bucket_name(lo, hi) for lo, hi in buckets]
  ppl = {}
  for label in labels:
    got = pooled(store.cells, label, n_windows)
    if got is not None:
      ppl[label] = ({b: (math.exp(s / c) if c else float("nan")) for b, (s, c) in got[0].items()}, got[1])
  ref = ppl.get("full", (None,))[0]
  rows = []
  for label, (p, recs) in ppl.items():
    cells = []
    for b in names:
      if math.isnan(p[b]):
        cells.append("–")
      elif ref is not None and label != "full" and not math.isnan(ref[b]):
        cells.append(f"{p[b]:.3f} ({100 * (p[b] / ref[b] - 1):+.2f}%)")
      else:
        cells.append(f"{p[b]:.3f}")
    hit = recs[0].get("spec_hit_rate")
    rows.append([label] + cells + [report.mib(recs[0]["device_bytes"]), "–" if hit is None else f"{hit:.3f}",
                                   f"{sum(r['seconds'] for r in recs):.0f}"])
  headers = ["method"] + [f"PPL {b}" for b in names] + ["device MiB", "spec. token hit", "seconds"]
  return headers, rows, ppl


def write_outputs(config, store, labels, buckets, command, seconds) -> str:
  out_dir = pathlib.Path(config.output_dir)
  headers, rows, ppl = table_rows(store, labels, buckets, config.num_windows)
  table = report.md_table(headers, rows)
  notes = [f"Model `{config.model}`; text `{config.corpus}`; {config.num_windows} window(s) of "
           f"{config.window_tokens} tokens; the first {config.prefix_tokens} prefilled, every later token "
           "teacher-forced through the cache (SpeCache's speculative row: the model's own greedy guess).",
           "Spec. token hit: how often the speculative row's token equalled the text's next token. Under "
           "teacher forcing the speculative chain follows the model's own guesses while the real row follows "
           "the text, so this is far lower than in free generation (see results/hitrate) and SpeCache's fetch "
           "set is chosen by a worse query than when decoding: a pessimistic setting for SpeCache. Labels "
           "ending in `_oracle` feed the text's true next token to the speculative row instead (the best "
           "case for the fetch set: what remains is the low-bit error on the rows not fetched).",
           f"Scored positions: {config.prefix_tokens}–{config.window_tokens - 1}. Buckets are absolute "
           "positions [lo, hi); a bucket beyond the window is '–'. In parentheses: change "
           "vs the 16-bit full cache. Device MiB: the cache's accelerator bytes for one window.",
           f"Wall time of this invocation: {seconds:.0f} s (cells reused from earlier runs are not re-timed)."]
  atomic_write_text(out_dir / "summary.md", report.header("Perplexity by position", command, notes) + "\n"
                    + table + "\n")
  plot_curves(store, labels, config.num_windows, out_dir / "perplexity.png")
  return table


def plot_curves(store, labels, n_windows, path):
  plt = report.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  for label in labels:
    got = pooled(store.cells, label, n_windows)
    if got is None:
      continue
    pts = np.asarray([c for r in got[1] for c in r["curve"]])
    xs = np.unique(pts[:, 0])
    ax.plot(xs, [np.exp(pts[pts[:, 0] == x, 1].mean()) for x in xs], label=label)
  ax.set_xlabel("position (tokens)")
  ax.set_ylabel(f"perplexity (mean NLL per {CURVE_BLOCK} tokens)")
  ax.set_yscale("log")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
