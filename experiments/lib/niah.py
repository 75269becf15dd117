"""Needle in a Haystack: context lengths × needle depths × cache methods, greedy answers checked for the needle.

Cases come from `specache_jax.data.niah` (Paul Graham essays as the haystack, a needle sentence at a relative
depth, a question, the chat template). The config's needle is asked at every (length, depth); `more_needles`
names further needles of `niah_data.NEEDLE_SET`, each asked at every cell too (a needle set of several
questions). The cells of one (method, length, needle) are decoded together as one ragged batch. A cell
(method + needle + length + depth) is stored as soon as its batch finishes, with the fingerprint of
everything that decides its answer; a restarted run skips stored cells. Outputs in `config.output_dir`:
results.json (every cell, its answer text), summary.md (the table), heatmap_<method>.png and heatmaps.png.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import numpy as np

from experiments.lib import methods, models, report
from experiments.lib.store import ResultStore, SweepResult, atomic_write_text, fingerprint
from specache_jax.caches.budget import BudgetBelowSmallest, device_bytes_at
from specache_jax.data import corpora
from specache_jax.data import niah as niah_data


PRIMARY = ""      # the config's own needle (config.needle, .question, .answer_keywords, .match)


def cell_id(label: str, length: int, depth: float, needle: str = PRIMARY) -> str:
  """E.g. "specache_1bit/len=1024_depth=0.50" (the config's needle) or "specache_1bit/needle=soup/len=..."."""
  return f"{label}/{f'needle={needle}/' if needle else ''}{niah_data.cell_id(length, depth)}"


def grid(config) -> tuple[list[int], list[float]]:
  lengths = report.parse_int_list(config.lengths, "lengths")
  depths = report.parse_float_list(config.depths, "depths")
  list(niah_data.grid(lengths, depths))   # validates: positive lengths, depths in [0, 1], no repeats
  return lengths, depths


def needle_spec(config) -> niah_data.NeedleSpec:
  keywords = tuple(k.strip() for k in config.answer_keywords.split(",") if k.strip())
  return niah_data.NeedleSpec(needle=config.needle, question=config.question, answer_keywords=keywords,
                              match=config.match)


def needles(config) -> dict[str, niah_data.NeedleSpec]:
  """key -> needle: PRIMARY (the config's needle) first, then `config.more_needles`' entries of NEEDLE_SET."""
  return {PRIMARY: needle_spec(config), **niah_data.needle_set(config.get("more_needles", ""))}


def needle_fingerprint(config, key: str) -> tuple:
  """What decides an answer besides the method (the config's own needle: its fields as the config spells them,
  so stores written before needle sets existed stay valid)."""
  if key == PRIMARY:
    return (config.model, config.dtype, config.needle, config.question, config.answer_keywords, config.match,
            config.max_new_tokens)
  spec = niah_data.NEEDLE_SET[key]
  return (config.model, config.dtype, spec.needle, spec.question, ",".join(spec.answer_keywords), spec.match,
          config.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class Case:
  prompt_ids: tuple[int, ...]     # the chat-formatted prompt
  depth: float                    # the depth used (after the sentence-boundary backoff)
  spec: niah_data.NeedleSpec
  needle_span: tuple[int, int] = (0, 0)   # prompt_ids[start:end]: the needle's tokens

  def check(self, answer: str) -> bool:
    return niah_data.score(answer, self.spec)


def build_cases(config, tokenizer, lengths, depths, needle: str = PRIMARY) -> dict[tuple[int, float], Case]:
  """(length, depth) -> the case: haystack + needle (`needles(config)[needle]`) + question as one user turn
  of the model's chat template, about `length` tokens in all."""
  spec = needles(config)[needle]
  haystack = corpora.long_text("paul_graham")

  def chat(context: str, question: str) -> str:
    return tokenizer.chat([{"role": "user", "content": f"{context}\n\nQuestion: {question} "
                                                       "Answer briefly from the text above."}])

  out = {}
  for n in lengths:
    for d in depths:
      case = niah_data.build_case(tokenizer, haystack, spec, n, d, formatter=chat)
      out[n, d] = Case(case.prompt_ids, case.depth, spec, case.needle_span)
  return out


def run(config, model=None, command: str = "python -m experiments.niah --config=configs/niah.py",
        log=print, mesh=None) -> SweepResult:
  start = time.time()
  model = model or models.load(config.model, config.dtype)
  dtype = model.params["embed"].dtype
  lengths, depths = grid(config)
  labels = methods.labels(config)
  specs = needles(config)
  cases = {key: build_cases(config, model.tokenizer, lengths, depths, key) for key in specs}
  stops = models.stop_ids(model)
  out_dir = pathlib.Path(config.output_dir)
  store = ResultStore(out_dir / "results.json", meta={"experiment": "niah", "command": command})
  computed = skipped = 0
  groups = [(label, n, key) for label in labels for n in lengths for key in specs]
  previous = None
  not_run: dict[tuple[str, int], str] = {}      # (label, length) -> why its cells cannot run
  for label, n, key in report.progress(groups, desc="niah"):
    if label != previous:      # a method's programs are not used again (ruler.py: vm.max_map_count)
      jax.clear_caches()
      previous = label
    fp = fingerprint(needle_fingerprint(config, key), dict(methods.settings_fingerprint_parts(config, label)))
    todo = [d for d in depths if not store.done(cell_id(label, n, d, key), fp)]
    skipped += len(depths) - len(todo)
    if not todo:
      continue
    if config.stop_after and store.computed >= config.stop_after:
      break
    prompts = [list(cases[key][n, d].prompt_ids) for d in todo]
    max_len = max(len(p) for p in prompts) + config.max_new_tokens + 2
    try:
      method = methods.build(config, label, model.config, max_len, dtype)
    except BudgetBelowSmallest as e:       # a matched budget below the method's smallest: no such setting here
      not_run[label, n] = str(e)
      log(f"niah {label} @ {n} tokens: not run ({e})")
      continue
    t0 = time.time()
    toks, nums, _ = models.generate_rows(model, prompts, max_new_tokens=config.max_new_tokens, cache=method,
                                         stop_tokens=stops, mesh=mesh)
    seconds = time.time() - t0
    info = dict(method=label, length=n, settings=methods.describe(method), batch_seconds=seconds,
                device_bytes=device_bytes_at(method, model.config, max_len, dtype))
    recs = {}
    for j, d in enumerate(todo):
      answer = models.decode_answer(model.tokenizer, toks[j], int(nums[j]), stops)
      recs[cell_id(label, n, d, key)] = dict(info, depth=d, depth_used=cases[key][n, d].depth, needle=key,
                                             prompt_tokens=len(prompts[j]), answer=answer,
                                             correct=bool(cases[key][n, d].check(answer)))
    store.put_many(recs, fp)
    computed += len(recs)
    needle = f" ({key})" if key else ""
    log(f"niah {label} @ {n} tokens{needle}: {sum(r['correct'] for r in recs.values())}/{len(recs)} correct "
        f"({seconds:.1f} s)")
  table = write_outputs(config, store, labels, lengths, depths, command, time.time() - start, list(specs),
                        not_run)
  return SweepResult(table, store.cells, computed, skipped, time.time() - start)


def summary_table(store: ResultStore, labels, lengths, depths, keys=(PRIMARY,)) -> tuple[str, list[str]]:
  """The (method, needle) × cell table (✓/✗, accuracy, device bytes) and notes on misses vs the full cache."""
  cols = [(n, d) for n in lengths for d in depths]
  headers = ["method"] + [f"{n}@{d:g}" for n, d in cols] + ["accuracy", "device MiB (max len)", "seconds"]
  rows, notes = [], []
  for label, key in [(label, key) for label in labels for key in keys]:
    row = _table_row(store, label, key, cols)
    if row is not None:
      rows.append(row[0])
      notes += row[1]
  if len(keys) > 1:
    notes += [f"- {label}, all needles: {found}/{total} (full retrieves {full_found} of the same cells)"
              for label, (found, total, full_found) in needle_totals(store, labels, cols, keys).items()]
  return report.md_table(headers, rows), notes


def needle_totals(store: ResultStore, labels, cols, keys) -> dict[str, tuple[int, int, int]]:
  """label -> (needles found, cells run, of those the cells the full cache gets right) over every needle."""
  out = {}
  for label in labels:
    recs = {(key, c): store.cells.get(cell_id(label, *c, key)) for key in keys for c in cols}
    done = {k: r for k, r in recs.items() if r is not None}
    if done:
      full = sum(bool(store.cells.get(cell_id("full", *c, key), {}).get("correct")) for key, c in done)
      out[label] = (sum(r["correct"] for r in done.values()), len(done), full)
  return out


def _table_row(store: ResultStore, label: str, key: str, cols):
  """(table row, notes) of one method and needle, or None when none of its cells was run."""
  recs = [store.cells.get(cell_id(label, n, d, key)) for n, d in cols]
  done = [r for r in recs if r is not None]
  if not done:
    return None
  name = f"{label} ({key})" if key else label
  marks = ["·" if r is None else ("✓" if r["correct"] else "✗") for r in recs]
  found = sum(r["correct"] for r in done)
  batches = {(r["length"], r["batch_seconds"]) for r in done}
  row = [name] + marks + [f"{found / len(done):.2f} ({found}/{len(done)})",
                          report.mib(max(r["device_bytes"] for r in done)), f"{sum(s for _, s in batches):.0f}"]
  full_ok = {c for c in cols if store.cells.get(cell_id("full", *c, key), {}).get("correct")}
  if label == "full" or not full_ok:
    return row, []
  missed = [f"{n}@{d:g}" for (n, d), r in zip(cols, recs) if (n, d) in full_ok and r is not None
            and not r["correct"]]
  return row, [f"- {name}: " + (f"misses {', '.join(missed)} that full retrieves" if missed
                                else "retrieves every needle the full cache retrieves")]


def answers_section(store: ResultStore, labels, lengths, depths, width: int = 90, keys=(PRIMARY,)) -> str:
  """Every stored answer, per needle, cell and method (what the ✓/✗ were judged on)."""
  lines = ["## Answers", ""]
  for key in keys:
    for n in lengths:
      for d in depths:
        lines.append(f"- `{n}@{d:g}`" + (f" ({key})" if key else ""))
        for label in labels:
          rec = store.cells.get(cell_id(label, n, d, key))
          if rec is None:
            continue
          text = " ".join(rec["answer"].split())
          text = text if len(text) <= width else text[:width - 1] + "…"
          lines.append(f"  - {label} {'✓' if rec['correct'] else '✗'}: {text}")
  return "\n".join(lines) + "\n"


def write_outputs(config, store, labels, lengths, depths, command, seconds, keys=(PRIMARY,), not_run=None) -> str:
  """not_run: (label, length) -> why those cells cannot run (a matched budget below the method's smallest)."""
  out_dir = pathlib.Path(config.output_dir)
  table, notes = summary_table(store, labels, lengths, depths, keys)
  notes += [f"- {label}: not run at {n} tokens ({why})" for (label, n), why in (not_run or {}).items()]
  batches = {(r["method"], r["length"], r["batch_seconds"]) for r in store.cells.values()
             if r.get("method") in labels}
  intro = [f"Model `{config.model}`; haystack: Paul Graham essays; columns `length@depth` (context tokens @ "
           f"relative needle depth); greedy, at most {config.max_new_tokens} new tokens, stop at EOS.",
           f"Needle: \"{config.needle}\" Question: \"{config.question}\" Correct if the answer contains "
           f"{config.match} of \"{config.answer_keywords}\" (case-insensitive). ✓ found, ✗ missed, · not run.",
           *[f"Needle `{k}` (rows \"method ({k})\"): \"{s.needle}\" Question: \"{s.question}\" Correct if the "
             f"answer contains {s.match} of \"{','.join(s.answer_keywords)}\"."
             for k, s in needles(config).items() if k],
           "Device MiB: the cache's accelerator bytes for one row at the longest context, in the model's dtype "
           "(StreamingLLM, H2O, Quest and InfLLM are sized to SpeCache 1-bit's bytes at each length).",
           f"Generation time summed over all cells (`seconds`, incl. compilation): "
           f"{sum(b[2] for b in batches):.0f} s; wall time of this invocation: {seconds:.0f} s (reused cells "
           "are not re-timed)."]
  text = report.header("Needle in a Haystack", command, intro) + "\n" + table + "\n"
  if notes:
    text += "\n" + "\n".join(notes) + "\n"
  text += "\n" + answers_section(store, labels, lengths, depths, keys=keys)
  atomic_write_text(out_dir / "summary.md", text)
  plot_heatmaps(store, labels, lengths, depths, out_dir, keys)
  return table


def plot_heatmaps(store, labels, lengths, depths, out_dir: pathlib.Path, keys=(PRIMARY,)) -> None:
  """heatmap_<label>.png per method and heatmaps.png with all of them side by side; a cell's colour is the
  fraction of the needles run there that were found (✓/✗ for one needle, "found/run" for several)."""
  plt = report.pyplot()
  from matplotlib.colors import LinearSegmentedColormap
  cmap = LinearSegmentedColormap.from_list("found", ["#d9534f", "#5cb85c"])
  shown = [lab for lab in labels
           if any(cell_id(lab, n, d, k) in store.cells for n in lengths for d in depths for k in keys)]

  def draw(ax, label):
    found_DL, run_DL = np.zeros((len(depths), len(lengths))), np.zeros((len(depths), len(lengths)))
    for i, d in enumerate(depths):
      for j, n in enumerate(lengths):
        recs = [r for k in keys if (r := store.cells.get(cell_id(label, n, d, k))) is not None]
        found_DL[i, j], run_DL[i, j] = sum(r["correct"] for r in recs), len(recs)
    with np.errstate(invalid="ignore"):
      frac = np.where(run_DL > 0, found_DL / np.maximum(run_DL, 1), np.nan)
    ax.imshow(np.ma.masked_invalid(frac), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i in range(len(depths)):
      for j in range(len(lengths)):
        if run_DL[i, j] == 1:
          mark = "✓" if found_DL[i, j] else "✗"
        else:
          mark = f"{found_DL[i, j]:.0f}/{run_DL[i, j]:.0f}" if run_DL[i, j] else ""
        ax.text(j, i, mark, ha="center", va="center", color="white", fontsize=14 if run_DL[i, j] == 1 else 10)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("needle depth")
    ax.set_title(label)

  for label in shown:
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.0 + 0.6 * len(depths)))
    draw(ax, label)
    fig.tight_layout()
    fig.savefig(out_dir / f"heatmap_{label}.png", dpi=110)
    plt.close(fig)
  if shown:
    fig, axes = plt.subplots(1, len(shown), figsize=(len(shown) * (1.0 + 1.1 * len(lengths)),
                                                     1.2 + 0.6 * len(depths)), squeeze=False)
    for ax, label in zip(axes[0], shown):
      draw(ax, label)
    fig.tight_layout()
    fig.savefig(out_dir / "heatmaps.png", dpi=110)
    plt.close(fig)
