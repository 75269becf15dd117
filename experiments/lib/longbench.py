"""LongBench: greedy predictions per task per cache method, the official scores, the paper's per-task table.

Data: a user-supplied directory in the official layout (`<task>.jsonl`, see `specache_jax.data.longbench`).
Per example: the official template, middle truncation to `max_prompt_tokens`, the chat template where the
official pred.py uses it, greedy decoding up to the task's official length (stopping at EOS, and at a newline
for the tasks where pred.py does). One cell per method × task × example; cells are stored as each batch
finishes, so a restarted run skips finished examples. Outputs per method: `<method>/<task>.jsonl` (the
official prediction format plus `_id`), and `scores.json` + `summary.md` for all.
"""
from __future__ import annotations

import json
import pathlib
import time

from experiments.lib import methods, models, report
from experiments.lib.store import (ResultStore, SweepResult, atomic_write_json, atomic_write_text,
                                   fingerprint)
from specache_jax.data import longbench as lb


def prompt_ids(tokenizer, task: str, example: lb.Example, max_prompt_tokens: int) -> list[int]:
  text = lb.build_prompt(task, example, tokenizer.encode, tokenizer.decode, max_prompt_tokens)
  if lb.uses_chat_template(task):
    return models.chat_ids(tokenizer, text)
  return list(tokenizer.encode(text))


def stop_tokens_for(model, task: str) -> tuple[int, ...]:
  stops = models.stop_ids(model)
  if lb.base_dataset(task) in lb.STOP_AT_NEWLINE:
    stops = stops + (int(model.tokenizer.encode("\n")[-1]),)
  return stops


def generation_length(config, task: str) -> int:
  n = lb.max_new_tokens(task)
  return min(n, config.max_new_tokens_cap) if config.max_new_tokens_cap else n


def run(config, model=None, command: str = "python -m experiments.longbench --config=configs/longbench.py",
        log=print, mesh=None) -> SweepResult:
  start = time.time()
  if not config.data_dir:
    raise ValueError("config.data_dir is empty: point it at a directory of LongBench jsonl files "
                     "(--config.data_dir=/path/to/LongBench/data)")
  tasks = [t.strip() for t in config.tasks.split(",") if t.strip()] or None
  data = lb.read_jsonl_dir(config.data_dir, tasks, limit=config.limit or None)
  model = model or models.load(config.model, config.dtype)
  dtype = model.params["embed"].dtype
  out_dir = pathlib.Path(config.output_dir)
  store = ResultStore(out_dir / "results.json", meta={"experiment": "longbench", "command": command})
  labels = methods.labels(config)
  computed = skipped = 0
  groups = [(label, task) for label in labels for task in data]
  for label, task in report.progress(groups, desc="longbench"):
    gen = generation_length(config, task)
    fp = fingerprint((config.model, config.dtype, config.max_prompt_tokens, gen),
                     dict(methods.settings_fingerprint_parts(config, label)))
    examples = data[task]
    todo = [ex for ex in examples if not store.done(f"{label}/{task}/{ex.id}", fp)]
    skipped += len(examples) - len(todo)
    stops = stop_tokens_for(model, task)
    for i in range(0, len(todo), config.batch_size):
      if config.stop_after and store.computed >= config.stop_after:
        break
      batch = todo[i:i + config.batch_size]
      ids = [prompt_ids(model.tokenizer, task, ex, config.max_prompt_tokens) for ex in batch]
      max_len = max(len(p) for p in ids) + gen + 2
      method = methods.build(config, label, model.config, max_len, dtype)
      t0 = time.time()
      toks, nums, _ = models.generate_rows(model, ids, max_new_tokens=gen, cache=method, stop_tokens=stops,
                                           mesh=mesh)
      seconds = time.time() - t0
      recs = {f"{label}/{task}/{ex.id}": dict(
          method=label, task=task, id=ex.id, prompt_tokens=len(p), seconds=seconds / len(batch),
          pred=models.decode_answer(model.tokenizer, toks[j], int(nums[j]), stops))
          for j, (ex, p) in enumerate(zip(batch, ids))}
      store.put_many(recs, fp)
      computed += len(recs)
    write_predictions(out_dir, store, label, task, examples)
  scores = score_all(store, labels, data)
  table = write_summary(config, scores, data, command, time.time() - start)
  log(f"longbench: {computed} prediction(s) computed, {skipped} reused")
  return SweepResult(table, scores, computed, skipped, time.time() - start)


def write_predictions(out_dir: pathlib.Path, store: ResultStore, label: str, task: str, examples) -> None:
  """`<out>/<method>/<task>.jsonl` with the stored predictions, in the data file's order."""
  lines = []
  for ex in examples:
    rec = store.cells.get(f"{label}/{task}/{ex.id}")
    if rec is not None:
      lines.append(json.dumps({"pred": rec["pred"], "answers": list(ex.answers), "all_classes": (
          None if ex.all_classes is None else list(ex.all_classes)), "length": ex.length, "_id": ex.id},
          ensure_ascii=False))
  atomic_write_text(out_dir / label / f"{task}.jsonl", "".join(line + "\n" for line in lines))


def score_all(store: ResultStore, labels, data) -> dict:
  """method -> task -> official score, for tasks whose examples all have predictions."""
  scores: dict = {}
  for label in labels:
    for task, examples in data.items():
      recs = [store.cells.get(f"{label}/{task}/{ex.id}") for ex in examples]
      if not examples or any(r is None for r in recs):
        continue
      preds, answers = [r["pred"] for r in recs], [list(ex.answers) for ex in examples]
      classes = examples[0].all_classes
      if task.endswith("_e"):
        scores.setdefault(label, {})[task] = lb.scorer_e(task, preds, answers, [ex.length for ex in examples],
                                                         classes)
      else:
        scores.setdefault(label, {})[task] = lb.scorer(task, preds, answers, classes)
  return scores


def write_summary(config, scores: dict, data: dict, command: str, seconds: float) -> str:
  out_dir = pathlib.Path(config.output_dir)
  atomic_write_json(out_dir / "scores.json", scores)
  paper = dict(lb.PAPER_TASKS)
  plain = [t for t in data if not t.endswith("_e")]
  columns = [(t, s) for t, s in lb.PAPER_TASKS if t in plain] + [(t, t) for t in plain if t not in paper]
  flat = {m: {t: v for t, v in per.items() if not isinstance(v, dict)} for m, per in scores.items()}
  table = lb.format_table(flat, columns) if flat and columns else "(no task finished yet)"
  counts = ", ".join(f"{t}: {len(v)}" for t, v in data.items())
  notes = [f"Model `{config.model}`; data `{config.data_dir}` ({counts} examples); prompts middle-truncated to "
           f"{config.max_prompt_tokens} tokens; greedy; official per-task generation lengths"
           + (f" capped at {config.max_new_tokens_cap}" if config.max_new_tokens_cap else "") + ".",
           f"Wall time of this invocation: {seconds:.0f} s."]
  atomic_write_text(out_dir / "summary.md", report.header("LongBench", command, notes) + "\n" + table + "\n")
  return table
