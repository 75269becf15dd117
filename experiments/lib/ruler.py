"""RULER (Hsieh et al. 2024): 13 tasks × context length × cache methods, RULER's scores with 95% intervals.

Samples come from `specache_jax.data.ruler` (generated here with the model's tokenizer, fitted so the prompt
plus the task's generation budget fits the length), wrapped in the model's chat template with RULER's answer
prefix after the assistant header; greedy decoding up to the task's budget, stopping at EOS. The samples of
one (method, length, task) are decoded in ragged batches of `batch_size` rows padded to one shape (the width
of the length, a full batch), so every task reuses one compiled program per generation budget. A cell
(method + sample) is stored as soon as its batch finishes; a restarted run skips stored cells. Outputs in
`config.output_dir`: results.json (every cell and its answer), summary.md (the paper's layout: a row per
method, a column per task, the average with its 95% interval; the per-task intervals), heatmap.png.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import time
import types

import jax
import numpy as np

from experiments.lib import methods, models, report
from experiments.lib.store import ResultStore, atomic_write_text, fingerprint
from specache_jax import decode
from specache_jax.caches.budget import device_bytes_at
from specache_jax.data import ruler as ruler_data
from specache_jax.data.ruler import qa as ruler_qa
from specache_jax.errors import ConfigError

GENERATOR_VERSION = 1      # bump when the generators change what a (task, length, index, seed) sample is


@dataclasses.dataclass
class Result:
  table: str                 # the markdown table printed by the launcher
  records: dict              # cell id -> record
  computed: int              # cells computed by this call
  skipped: int               # cells reused from the result file
  seconds: float


def cell_id(label: str, task: str, length: int, index: int) -> str:
  """E.g. "specache_1bit/vt/len=4096/i=3"."""
  return f"{label}/{ruler_data.sample_id(task, length, index)}"


def task_list(config) -> list[str]:
  chosen = [t.strip() for t in str(config.tasks).split(",") if t.strip()]
  unknown = [t for t in chosen if t not in ruler_data.TASKS]
  if unknown or not chosen:
    raise ConfigError(f"tasks={config.tasks!r}: {unknown or 'none chosen'}; choose from {list(ruler_data.TASKS)}")
  if len(set(chosen)) != len(chosen):
    raise ConfigError(f"tasks={config.tasks!r} repeats a task")
  return chosen


def gen_budget(config, task: str) -> int:
  """The task's RULER generation budget, or `max_new_tokens_cap` when that is smaller (faster, unofficial)."""
  own = ruler_data.gen_tokens(task)
  return min(own, config.max_new_tokens_cap) if config.max_new_tokens_cap > 0 else own


def check(config, mesh=None) -> None:
  if config.samples < 1:
    raise ConfigError(f"samples={config.samples} must be >= 1")
  if config.batch_size < 1:
    raise ConfigError(f"batch_size={config.batch_size} must be >= 1")
  if mesh is not None and config.batch_size % int(dict(mesh.shape)["data"]):
    raise ConfigError(f"batch_size={config.batch_size} must be a multiple of the mesh's data axis "
                      f"({dict(mesh.shape)['data']})")


def wilson(mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
  """The Wilson score interval of a proportion `mean` over `n` samples (a sample's score in [0, 1] counts as a
  proportion; its variance is at most mean·(1-mean), so the interval is conservative for partial scores)."""
  if n <= 0:
    return (math.nan, math.nan)
  denom = 1 + z * z / n
  center = (mean + z * z / (2 * n)) / denom
  half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denom
  return max(0.0, center - half), min(1.0, center + half)


def run(config, model=None, command: str = "python -m experiments.ruler --config=configs/ruler.py",
        log=print, mesh=None) -> Result:
  start = time.time()
  check(config, mesh)
  tasks = task_list(config)
  lengths = report.parse_int_list(config.lengths, "lengths")
  labels = methods.labels(config)
  data_files = {"squad": config.squad, "hotpotqa": config.hotpotqa}
  for task in tasks:                          # a missing QA file is reported before any model work
    if task.startswith("qa_"):
      try:
        ruler_qa.data_path(ruler_data.TASKS[task].dataset, data_files)
      except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
  model = model or models.load(config.model, config.dtype)
  dtype = model.params["embed"].dtype
  tok = model.tokenizer
  stops = models.stop_ids(model)
  store = ResultStore(pathlib.Path(config.output_dir) / "results.json",
                      meta={"experiment": "ruler", "command": command})
  samples: dict[tuple[str, int, int], ruler_data.Sample] = {}

  def sample(task, n, i):
    if (task, n, i) not in samples:
      samples[task, n, i] = ruler_data.generate(task, n, i, config.seed, tok, formatter=ruler_data.chat(tok),
                                                data_files=data_files)
    return samples[task, n, i]

  base_fp = (config.model, config.dtype, config.seed, GENERATOR_VERSION)
  computed = skipped = 0
  groups = [(label, n, task) for label in labels for n in lengths for task in tasks]
  previous = None
  for label, n, task in report.progress(groups, desc="ruler"):
    if label != previous:
      # Each XLA:CPU executable keeps its JIT code in memory mappings of its own; a whole sweep's programs
      # (one per method and generation budget, 30 unrolled layers each) passed Linux's vm.max_map_count after
      # ~4 methods and the next compilation failed ("LLVM compilation error: Cannot allocate memory"). A
      # method's programs are not used again once the next method starts.
      jax.clear_caches()
      previous = label
    budget = gen_budget(config, task)
    fp = fingerprint(base_fp, task, budget, dict(methods.settings_fingerprint_parts(config, label)))
    todo = [i for i in range(config.samples) if not store.done(cell_id(label, task, n, i), fp)]
    skipped += config.samples - len(todo)
    max_len = n + 2                            # prompt + generation <= n, plus SpeCache's speculative row
    method = methods.build(config, label, model.config, max_len, dtype) if todo else None
    for b in range(0, len(todo), config.batch_size):
      if config.stop_after and store.computed >= config.stop_after:
        break
      batch = todo[b:b + config.batch_size]
      rows = [sample(task, n, i) for i in batch]
      tokens_BW, lengths_B = _padded_batch(rows, config.batch_size, budget)
      t0 = time.time()
      toks, nums, _ = models.generate_rows(model, list(tokens_BW), lengths=lengths_B, max_new_tokens=budget,
                                           cache=method, stop_tokens=stops, mesh=mesh)
      seconds = time.time() - t0
      info = dict(method=label, task=task, length=n, gen_tokens=budget, batch_seconds=seconds,
                  batch_rows=len(batch), settings=methods.describe(method),
                  device_bytes=device_bytes_at(method, model.config, max_len, dtype))
      recs = {}
      for j, (i, s) in enumerate(zip(batch, rows)):
        answer = models.decode_answer(tok, toks[j], int(nums[j]), stops)
        recs[cell_id(label, task, n, i)] = dict(
            info, index=i, prompt_tokens=len(s.prompt_ids), haystack_size=s.size,
            prompt_sha=hashlib.sha256(np.asarray(s.prompt_ids, np.int32).tobytes()).hexdigest()[:16],
            references=list(s.answers), metric=s.metric, answer=answer,
            score=ruler_data.sample_score(answer, s.answers, s.metric))
      store.put_many(recs, fp)
      computed += len(recs)
      log(f"ruler {label} {task} @ {n}: {sum(r['score'] for r in recs.values()):.2f}/{len(recs)} "
          f"({seconds:.1f} s)")
  table = write_outputs(config, store, labels, lengths, tasks, command, time.time() - start)
  return Result(table, store.cells, computed, skipped, time.time() - start)


def _padded_batch(rows, batch_size: int, gen_tokens: int):
  """tokens [batch_size, W] and lengths [batch_size], the last row repeated to fill the batch (its outputs are
  dropped). W is the cache's own slot count for the batch (longest prompt + generation + at least one decode
  row, rounded up to decode.SLOT_ROUNDING), so prefill and cache share one shape and the tasks of a length and
  generation budget reuse one compiled program."""
  quantum = decode.SLOT_ROUNDING
  width = -(-(max(len(r.prompt_ids) for r in rows) + gen_tokens + 1) // quantum) * quantum
  tokens_BW = np.zeros((batch_size, width), np.int32)
  lengths_B = np.zeros((batch_size,), np.int32)
  for j in range(batch_size):
    ids = rows[min(j, len(rows) - 1)].prompt_ids
    tokens_BW[j, :len(ids)] = ids
    lengths_B[j] = len(ids)
  return tokens_BW, lengths_B


# ------------------------------------------------------------------------------------------------- outputs
def scores(store: ResultStore, labels, length: int, tasks) -> dict:
  """label -> task -> (mean score x100, n, lo x100, hi x100); label -> "avg" over the tasks run."""
  out = {}
  for label in labels:
    per = {}
    for task in tasks:
      got = [r["score"] for k, r in store.cells.items()
             if r.get("method") == label and r.get("task") == task and r.get("length") == length]
      if got:
        mean = float(np.mean(got))
        lo, hi = wilson(mean, len(got))
        per[task] = (100 * mean, len(got), 100 * lo, 100 * hi)
    if per:
      avg = float(np.mean([v[0] for v in per.values()])) / 100
      n = sum(v[1] for v in per.values())
      lo, hi = wilson(avg, n)
      per["avg"] = (100 * avg, n, 100 * lo, 100 * hi)
      out[label] = per
  return out


def summary_tables(store, labels, length: int, tasks) -> tuple[str, str, list[str]]:
  """(scores table in the paper's layout, intervals table, notes)."""
  sc = scores(store, labels, length, tasks)
  cols = [ruler_data.SHORT[t] for t in tasks]
  rows, irows = [], []
  full = sc.get("full", {})
  for label, per in sc.items():
    cells = [f"{per[t][0]:.1f}" if t in per else "·" for t in tasks]
    a = per["avg"]
    delta = f"{a[0] - full['avg'][0]:+.1f}" if full and label != "full" else ""
    seconds = sum(r["batch_seconds"] / r["batch_rows"] for r in store.cells.values()
                  if r.get("method") == label and r.get("length") == length)
    rows.append([label] + cells + [f"{a[0]:.1f} [{a[2]:.1f}, {a[3]:.1f}]", delta, str(a[1]), f"{seconds:.0f}"])
    irows.append([label] + [f"[{per[t][2]:.0f}, {per[t][3]:.0f}]" if t in per else "·" for t in tasks])
  table = report.md_table(["method"] + cols + ["avg [95% CI]", "Δ avg vs full", "samples", "seconds"], rows)
  itable = report.md_table(["method"] + cols, irows)
  notes = []
  if full:
    zero = [ruler_data.SHORT[t] for t in tasks if t in full and full[t][0] == 0]
    solid = [ruler_data.SHORT[t] for t in tasks if t in full and full[t][0] >= 50]
    notes.append(f"- Full cache: {full['avg'][0]:.1f} on average; scores 0 on "
                 f"{', '.join(zero) or 'no task'}; at least 50 on {', '.join(solid) or 'no task'}.")
    for label, per in sc.items():
      if label == "full":
        continue
      worse = [f"{ruler_data.SHORT[t]} {per[t][0] - full[t][0]:+.1f}" for t in tasks
               if t in per and t in full and per[t][0] < full[t][0]]
      notes.append(f"- {label}: " + (f"below full on {', '.join(worse)}" if worse else "never below full"))
  return table, itable, notes


def answers_section(store, labels, length: int, tasks, width: int = 80) -> str:
  """The first sample's answer per task and method (what the scores were judged on)."""
  lines = ["## First sample's answers", ""]
  for task in tasks:
    recs = [(label, store.cells.get(cell_id(label, task, length, 0))) for label in labels]
    recs = [(lab, r) for lab, r in recs if r is not None]
    if not recs:
      continue
    lines.append(f"- `{task}` (references: {', '.join(recs[0][1]['references'])})")
    for label, r in recs:
      text = " ".join(r["answer"].split())
      text = text if len(text) <= width else text[:width - 1] + "…"
      lines.append(f"  - {label} ({100 * r['score']:.0f}): {text}")
  return "\n".join(lines) + "\n"


def sample_counts(store: ResultStore, labels) -> dict[str, int]:
  """label -> how many sample indices it has stored cells for (any task or length)."""
  return {label: len({r.get("index") for r in store.cells.values() if r.get("method") == label})
          for label in labels if any(r.get("method") == label for r in store.cells.values())}


def subset_notes(store: ResultStore, labels, length: int, tasks, ran: dict[str, int], most: int) -> list[str]:
  """For each label that ran fewer samples than the others: the full cache's average over the same samples and
  tasks (the like-for-like comparison; the table's Δ compares with all of full's)."""
  notes = []
  for label, k in ran.items():
    if k >= most or label == "full":
      continue
    view = _first_samples(store, k)
    own = scores(view, [label], length, tasks).get(label, {})
    done = [t for t in tasks if t in own]
    full = scores(view, ["full"], length, done).get("full", {})
    if done and "avg" in full:
      notes.append(f"- {label} ran the first {k} sample(s) of {len(done)} task(s): {own['avg'][0]:.1f} on "
                   f"average, the full cache {full['avg'][0]:.1f} on the same samples "
                   f"({own['avg'][0] - full['avg'][0]:+.1f}).")
  return notes


def _first_samples(store: ResultStore, k: int):
  """A view of the store with the cells of sample indices < k only (what `scores` reads: `.cells`)."""
  return types.SimpleNamespace(cells={c: r for c, r in store.cells.items() if r.get("index", 0) < k})


def write_outputs(config, store, labels, lengths, tasks, command, seconds) -> str:
  out_dir = pathlib.Path(config.output_dir)
  ran = sample_counts(store, labels)
  most = max(ran.values(), default=config.samples)
  fewer = ", ".join(f"{label}: {k}" for label, k in ran.items() if k < most)
  intro = [f"Model `{config.model}`; RULER's 13 tasks generated here (`specache_jax/data/ruler`, seed "
           f"{config.seed}), {most} samples per task"
           + (f" ({fewer}: a subset, the first samples of each task)" if fewer else "")
           + "; the model's chat template, then RULER's answer "
           "prefix; greedy, each task's generation budget"
           + (f" capped at {config.max_new_tokens_cap}" if config.max_new_tokens_cap else "") + ", stop at EOS.",
           "Scores: RULER's string_match_all (niah, vt, cwe, fwe) and string_match_part (qa), ×100. Intervals: "
           "95% Wilson intervals over the samples (the average's over all its samples). StreamingLLM, H2O, "
           "Quest and InfLLM are sized to SpeCache 1-bit's device bytes. `seconds`: generation time summed over "
           "batches (incl. compilation).",
           f"Wall time of this invocation: {seconds:.0f} s (reused cells are not re-timed)."]
  text = report.header("RULER", command, intro)
  first = ""
  for n in lengths:
    table, itable, notes = summary_tables(store, labels, n, tasks)
    first = first or table
    text += f"\n## {n} tokens\n\n{table}\n\n95% intervals per task:\n\n{itable}\n"
    notes += subset_notes(store, labels, n, tasks, ran, most)
    if notes:
      text += "\n" + "\n".join(notes) + "\n"
    text += "\n" + answers_section(store, labels, n, tasks)
  atomic_write_text(out_dir / "summary.md", text)
  plot_heatmap(store, labels, lengths, tasks, out_dir)
  return first


def plot_heatmap(store, labels, lengths, tasks, out_dir: pathlib.Path) -> None:
  """heatmap.png: methods × tasks (+ the average), the score in each cell; one panel per length."""
  plt = report.pyplot()
  panels = [(n, scores(store, labels, n, tasks)) for n in lengths]
  panels = [(n, sc) for n, sc in panels if sc]
  if not panels:
    return
  cols = tasks + ["avg"]
  fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                           figsize=(1.6 + 0.75 * len(cols), 0.9 + 0.5 * len(labels) * len(panels)))
  for ax, (n, sc) in zip(axes[:, 0], panels):
    shown = [lab for lab in labels if lab in sc]
    grid_MT = np.full((len(shown), len(cols)), np.nan)
    for i, lab in enumerate(shown):
      for j, t in enumerate(cols):
        if t in sc[lab]:
          grid_MT[i, j] = sc[lab][t][0]
    ax.imshow(np.ma.masked_invalid(grid_MT), cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for i in range(len(shown)):
      for j in range(len(cols)):
        if not np.isnan(grid_MT[i, j]):
          ax.text(j, i, f"{grid_MT[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(cols)), [ruler_data.SHORT.get(t, "Avg") for t in cols])
    ax.set_yticks(range(len(shown)), shown)
    ax.set_title(f"RULER @ {n} tokens")
  fig.tight_layout()
  fig.savefig(out_dir / "heatmap.png", dpi=110)
  plt.close(fig)
