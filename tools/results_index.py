"""Writes results/README.md: an index of every committed result, generated from the result files themselves.

  python tools/results_index.py            # rewrites results/README.md
  python tools/results_index.py --check    # exits 1 when results/README.md differs from what this writes

A result is the files of one run: a store directory (`summary.md`, `results.json` or `table.json`, its PNGs) or
the files sharing a stem beside each other (`peer_cpu.md`, `peer_cpu.json`, and a PNG an `.md` links to). For
each the index gives what it is (the `.md` title), the command the file records (`.md` first, then the JSON's),
the date it records and a headline number read from the JSON by the kind of run (`KINDS`). A run of a kind
nobody taught this script still gets a row, with its title and command. `tests/test_docs.py` checks that the
committed index is this script's output.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
STORE_FILES = ("summary.md", "results.json", "table.json")
# Labels a headline names first, when a run has them (the rest are counted).
PREFERRED = ("full", "specache_1bit", "specache_1bit_robust", "specache_2bit", "specache_1bit_eom", "kivi_2bit",
             "kivi_1bit", "specache_1bit_offload", "specache_1bit_robust_offload", "hf_dynamic")
MAX_LABELS = 5
# Why a run sits in results/archive/ (a run there without a line here is listed without one).
ARCHIVED = {
    "archive/cpu_kernels": "the same benchmark rerun as `cpu_kernels_1207` after the 2-bit tables and the "
                           "vectorized ring keys",
    "archive/peer_cpu_prefill_4k_b1": "a recheck of one prefill cell of `peer_cpu`; `peer_cpu_b1_prefill5` reran "
                                      "the whole batch-1 row with 5 prefills per method",
    "archive/caches_cpu": "decode steps per method measured before the CPU kernels and the in-place cache "
                          "updates, through the whole-model forward with stacked weights and no donation; "
                          "`caches_cpu` reran it at a later commit with the decoding loop's step",
    "archive/ablations_1203": "the ablation table of 2026-12-03, before the in-place caches and the kernels; "
                              "`ablations` reran it whole at a later commit, with the residual length and "
                              "pre-decoding variants",
    "archive/perplexity_1203": "perplexity by position of 2026-12-03, before the in-place caches and the "
                               "kernels; `perplexity` reran the same labels at a later commit",
}
SECTIONS = (("accuracy", "Accuracy: retrieval, RULER, perplexity, speculation"),
            ("speed", "Speed: decode steps, prefill, kernels"),
            ("other", "Other"),
            ("archive", "Archive: superseded runs (kept for their history)"))


@dataclasses.dataclass
class Entry:
  """One run: its files (paths relative to results/), what it is, its command, date and headline."""
  key: str
  files: list[str]
  title: str = ""
  command: str = ""
  more_commands: int = 0
  date: str = ""
  headline: str = ""
  section: str = "other"


# ------------------------------------------------------------------------------------------- reading files
def _group(results: pathlib.Path) -> list[Entry]:
  """The files under results/ grouped into runs (README.md itself left out)."""
  groups: dict[str, list[str]] = defaultdict(list)
  for path in sorted(results.rglob("*")):
    if not path.is_file() or path == results / "README.md":
      continue
    rel = path.relative_to(results).as_posix()
    folder = path.parent
    if any((folder / name).exists() for name in STORE_FILES) and (
        path.name in STORE_FILES or path.suffix == ".png" and not (folder / f"{path.stem}.md").exists()):
      groups[folder.relative_to(results).as_posix()].append(rel)
    else:
      stem = path.relative_to(results).with_suffix("").as_posix()
      groups[stem].append(rel)
  # A lone PNG that an .md beside it links to belongs to that .md's run.
  for key in [k for k, files in groups.items() if all(f.endswith(".png") for f in files)]:
    name = key.rsplit("/", 1)[-1] + ".png"
    parent = (results / key).parent
    for md in sorted(parent.glob("*.md")):
      if f"({name})" in md.read_text(encoding="utf-8"):
        owner = md.relative_to(results).with_suffix("").as_posix()
        if owner in groups:
          groups[owner] += groups.pop(key)
          break
  return [Entry(key, sorted(files)) for key, files in sorted(groups.items())]


_COMMAND_RES = (
    re.compile(r"```(?:bash|sh)?\n((?:python|bash) [^\n]+(?:\n[^`\n][^\n]*)*)\n```"),   # Reproduce: ```bash ...```
    re.compile(r"^\s*(?:- )?`((?:python|bash) [^`]+)`", re.MULTILINE),                    # `cmd` on its own line
    re.compile(r"[Cc]ommand: `((?:python|bash) [^`]+)`"),                                  # Command: `cmd`
    re.compile(r"^ {4}((?:python|bash) [^\n]+)", re.MULTILINE),                           # an indented block
)
_DATE_RE = re.compile(r"(20\d\d-\d\d-\d\d)(?:[ T](\d\d:\d\d))?")


def _md_command(text: str) -> str:
  found = [(m.start(), m.group(1)) for r in _COMMAND_RES for m in r.finditer(text)]
  return " ".join(min(found)[1].split()) if found else ""


def _json_commands(data) -> list[str]:
  if not isinstance(data, dict):
    return []
  meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
  if meta.get("merged_runs"):
    return [run["command"] for run in meta["merged_runs"] if isinstance(run, dict) and "command" in run]
  for holder in (meta, data):
    if isinstance(holder.get("command"), str):
      return [holder["command"]]
  commands = data.get("commands")
  return [c for c in commands if isinstance(c, str)] if isinstance(commands, list) else []


def _json_date(data) -> str:
  if not isinstance(data, dict):
    return ""
  meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
  for holder in (meta.get("machine_start"), meta.get("machine"), data.get("machine"),
                 (data.get("machines") or [None])[0] if isinstance(data.get("machines"), list) else None):
    if isinstance(holder, dict) and isinstance(holder.get("time"), str):
      m = _DATE_RE.search(holder["time"])
      if m:
        return " ".join(g for g in m.groups() if g)
  return ""


def _load(results: pathlib.Path, entry: Entry) -> tuple[str, object]:
  """The entry's .md text (summary.md first) and its JSON (results.json / table.json / <stem>.json)."""
  mds = sorted((f for f in entry.files if f.endswith(".md")), key=lambda f: not f.endswith("summary.md"))
  jsons = sorted((f for f in entry.files if f.endswith(".json")), key=lambda f: not f.endswith("results.json"))
  text = (results / mds[0]).read_text(encoding="utf-8") if mds else ""
  data = json.loads((results / jsons[0]).read_text(encoding="utf-8")) if jsons else None
  return text, data


# ------------------------------------------------------------------------------------------ headlines by kind
def _ordered(labels) -> list[str]:
  labels = list(dict.fromkeys(labels))
  first = [label for label in PREFERRED if label in labels]
  return first + [label for label in labels if label not in first]


def _name_some(parts: dict[str, str], unit: str = "methods") -> str:
  """'a x, b y, … (N methods)' with the preferred labels first, at most MAX_LABELS named."""
  order = _ordered(parts)
  shown = ", ".join(f"{label} {parts[label]}" for label in order[:MAX_LABELS])
  return shown + (f"; {len(order)} {unit} in all" if len(order) > MAX_LABELS else "")


def _store_cells(data) -> dict[str, list[dict]]:
  by_method: dict[str, list[dict]] = defaultdict(list)
  for key, cell in data["cells"].items():
    by_method[cell.get("method", key.split("/", 1)[0])].append(cell)
  return by_method


def _niah(data) -> str:
  counts = {m: f"{sum(bool(c['correct']) for c in cells)}/{len(cells)}" for m, cells in _store_cells(data).items()}
  return "needles found: " + _name_some(counts)


def _ruler(data) -> str:
  averages = {}
  for method, cells in _store_cells(data).items():
    by_task: dict[str, list[float]] = defaultdict(list)
    for c in cells:
      by_task[c["task"]].append(float(c["score"]))
    averages[method] = f"{100 * sum(sum(v) / len(v) for v in by_task.values()) / len(by_task):.1f}"
  tasks = {c["task"] for cells in _store_cells(data).values() for c in cells}
  return f"average score over {len(tasks)} tasks (×100): " + _name_some(averages)


def _perplexity(data) -> str:
  cells = {m: cs[0] for m, cs in _store_cells(data).items()}
  first = next(iter(cells.values()))
  bucket = [b for b in first["nll_sum"] if first["count"].get(b)][-1]   # the last bucket the window reaches
  ppl = {m: math.exp(c["nll_sum"][bucket] / c["count"][bucket]) for m, c in cells.items()
         if c["count"].get(bucket)}
  full = ppl.get("full")
  return f"perplexity over positions {bucket}: " + _name_some(
      {m: f"{p:.2f}" + (f" ({p / full:.2f}× full)" if full and m != "full" else "") for m, p in ppl.items()})


def _hitrate(data) -> str:
  rates = {m: f"{cs[0]['exact_hit_rate']:.2f} / {cs[0]['topk_hit_rate']:.2f}"
           for m, cs in _store_cells(data).items() if "exact_hit_rate" in cs[0]}
  return "exact-token / top-k hit rate: " + _name_some(rates)


def _needle_rank(data) -> str:
  retrieving: dict[str, float] = defaultdict(float)
  kept: dict[str, float] = defaultdict(float)
  for cell in data["cells"].values():
    summary = cell["summary"]
    for rule, stats in summary.items():
      if isinstance(stats, dict) and rule != "exact":
        retrieving[rule] += summary["retrieving"]
        kept[rule] += summary["retrieving"] * stats["recall_at_k"]
  return "pooled recall@k of the exact top-k needle rows from low-bit keys: " + ", ".join(
      f"{rule} {kept[rule] / retrieving[rule]:.2f}" for rule in retrieving)


def _ablations(data) -> str:
  found = {label: f"{row['niah_correct']}/{row['niah_cells']}" for label, row in data.items()
           if isinstance(row, dict) and "niah_correct" in row}
  return "needles found: " + _name_some(found, unit="settings")


def _speculation_table(data) -> str:
  rows = {row["label"]: row for row in data["rows"]}
  meets = [label for label, row in rows.items() if row.get("meets")]
  head = rows.get("specache_1bit_robust") or rows[next(iter(rows))]
  parts = [f"{head['label']}: NIAH {head['niah'][0]}/{head['niah'][1]}" if head.get("niah") else head["label"]]
  if head.get("ruler") is not None:
    parts.append(f"RULER {head['ruler']:.1f} ({head['ruler_vs_full']:.2f}× full)")
  if head.get("ppl") is not None:
    parts.append(f"PPL {head['ppl']:.2f} ({head['ppl_vs_full']:.3f}× full)")
  return ", ".join(parts) + f"; {len(rows)} variants, {len(meets)} meeting the bar ({', '.join(meets) or 'none'})"


def _step_cell(cells: list[dict]) -> dict:
  """The cell a speed headline quotes: the longest context at the smallest batch."""
  return max(cells, key=lambda c: (int(c["context"]), -int(c["batch"])))


def _peer(data) -> str:
  cell = _step_cell(data["cells"])
  steps = {m: f"{1e3 * r['step_s']:.1f}" + (f" ({r['decode_speed_vs_ref']:.2f}×)" if m != "hf_dynamic" else "")
           for m, r in cell["methods"].items() if r.get("step_s")}
  return (f"ms per decode step at {cell['context']} tokens, batch {cell['batch']} (× HF DynamicCache's tok/s): "
          + _name_some(steps))


def _caches(data) -> str:
  cell = _step_cell(data["cells"])
  steps = {m: f"{1e3 * r['step']['median_s']:.1f}" for m, r in cell["methods"].items()}
  return f"ms per decode step at {cell['context']} tokens, batch {cell['batch']}: " + _name_some(steps)


def _throughput(data) -> str:
  hidden = []
  for name, s in data.get("overlap", {}).get("stores", {}).items():
    if "fraction_hidden" in s:
      hidden.append(f"{name} store {s['fraction_hidden']:.2f}")
  cell = _step_cell(data["cells"])
  steps = {m: f"{1e3 * r['step_s']:.1f}" for m, r in cell["methods"].items()}
  return (f"ms per decode step at {cell['context']} tokens, batch {cell['batch']}: " + _name_some(steps)
          + ("; share of the host fetch hidden behind compute: " + ", ".join(hidden) if hidden else ""))


def _capped(data) -> str:
  """The longest context where the reference fits: each method's max batch and its tok/s ratio there."""
  meta, contexts = data["meta"], data["contexts"]
  ref = meta.get("reference", "full")
  fitting = [c for c in contexts if c["plans"].get(ref, {}).get("max_batch")] or contexts
  ctx = max(fitting, key=lambda c: c["context"])
  parts = {}
  for label, p in ctx["plans"].items():
    if "max_batch" in p:
      ratio = p.get("tokens_per_s_ratio")
      parts[label] = f"{p['max_batch']}" + (f" ({ratio:.2f}× tok/s)" if ratio is not None else "")
  cap = meta["cap_gib"]
  cap_text = f"{cap:g} GiB" if cap >= 1 else f"{meta['cap_bytes'] / 2**20:.4g} MiB"
  return f"max batch under a {cap_text} cap at {ctx['context']} tokens (decode tok/s × {ref}'s): " + _name_some(parts)


def _cpu_kernels(data) -> str:
  cell = max(data["steps"], key=lambda c: (int(c["S"]), -int(c["B"])))
  steps = {m: " / ".join(f"{v[mode]['ms_per_step']:.1f}" if mode in v else "–"
                         for mode in ("kernel", "matmul", "xla")) for m, v in cell["methods"].items()}
  return (f"ms per decode step at {cell['S']} tokens, batch {cell['B']}, with every kernel / the matmul kernel "
          "only / none: " + _name_some(steps))


def _topk(data) -> str:
  cell = max(data["cells"], key=lambda c: (int(c["S"]), -int(c["B"])))
  times = {v: f"{r['ms_per_layer']:.3f}" for v, r in cell["variants"].items()}
  return f"ms per layer at S={cell['S']}, batch {cell['B']}: " + _name_some(times, unit="variants")


def _packed(data) -> str:
  cells = [c for c in data["cells"] if int(c["bits"]) == 1] or data["cells"]
  cell = max(cells, key=lambda c: (int(c["S"]), -int(c["B"])))
  speed = {v: f"{r['speedup_vs_baseline']:.2f}×" for v, r in cell["variants"].items()
           if "speedup_vs_baseline" in r and v != "baseline_attn"}
  return (f"{cell['bits']}-bit, S={cell['S']}, batch {cell['B']}, speed-up over the dequantizing attention: "
          + _name_some(speed, unit="variants"))


def _prefill(data) -> str:
  walls = {f"{int(ctx) // 1024}k": f"{r['results']['new']['wall_s']:.1f} s" for ctx, r in data["model"].items()
           if "new" in r.get("results", {})}
  return "a whole SmolLM2 prefill, batch 1: " + ", ".join(f"{k} {v}" for k, v in walls.items())


def _kernel_bench(data) -> str:
  checks = data.get("checks", [])
  ok = sum(bool(c.get("ok")) for c in checks)
  worst = max((c.get("max_scaled_error", 0.0) for c in checks), default=0.0)
  return (f"{ok} of {len(checks)} kernel checks within tolerance (largest scaled error {worst:.1e}); "
          f"{len(data.get('timings', []))} timings ({data.get('mode', '')})")


def _experiment(name):
  return lambda data: isinstance(data, dict) and isinstance(data.get("meta"), dict) and (
      data["meta"].get("experiment") == name or data["meta"].get("benchmark") == name)


# (recognizer, section, headline, title when no .md says): first match wins.
KINDS = (
    (_experiment("niah"), "accuracy", _niah, ""),
    (_experiment("ruler"), "accuracy", _ruler, ""),
    (_experiment("perplexity"), "accuracy", _perplexity, ""),
    (_experiment("hitrate"), "accuracy", _hitrate, ""),
    (_experiment("needle_rank"), "accuracy", _needle_rank, ""),
    (lambda d: isinstance(d, dict) and isinstance(d.get("rows"), list) and "label" in (d["rows"] or [{}])[0],
     "accuracy", _speculation_table, ""),
    (lambda d: isinstance(d, dict) and d and all(isinstance(v, dict) and "niah_correct" in v for v in d.values()),
     "accuracy", _ablations, ""),
    (_experiment("peer"), "speed", _peer, ""),
    (_experiment("caches"), "speed", _caches, ""),
    (_experiment("throughput"), "speed", _throughput, ""),
    (_experiment("capped_throughput"), "speed", _capped, ""),
    (lambda d: isinstance(d, dict) and {"products", "steps"} <= set(d), "speed", _cpu_kernels, ""),
    (lambda d: isinstance(d, dict) and "variants" in ((d.get("cells") or [{}])[0]) and "bits" not in d["cells"][0],
     "speed", _topk, ""),
    (lambda d: isinstance(d, dict) and "variants" in ((d.get("cells") or [{}])[0]), "speed", _packed, ""),
    (lambda d: isinstance(d, dict) and {"commands", "model"} <= set(d), "speed", _prefill, ""),
    (lambda d: isinstance(d, dict) and "checks" in d, "speed", _kernel_bench,
     "The Pallas kernels vs their float32 references"),
)


def describe(results: pathlib.Path, entry: Entry) -> Entry:
  text, data = _load(results, entry)
  title = re.search(r"^# (.+)$", text, re.MULTILINE)
  entry.title = title.group(1).strip() if title else ""
  commands = _json_commands(data)
  entry.command = _md_command(text) or (" ".join(commands[0].split()) if commands else "")
  entry.more_commands = max(len(commands) - 1, 0)
  date = _DATE_RE.search(text)
  entry.date = " ".join(g for g in date.groups() if g) if date else _json_date(data)
  for recognize, section, headline, title_default in KINDS:
    try:
      known = bool(recognize(data))
    except (KeyError, TypeError, IndexError, AttributeError):   # a layout the recognizer does not expect
      known = False
    if known:
      entry.section = section
      entry.title = entry.title or title_default
      try:
        entry.headline = headline(data)
      except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError, StopIteration) as e:
        entry.headline = f"(no headline: the file's layout is not the one this script reads: {e!r})"
      break
  if entry.key.split("/", 1)[0] == "archive":
    entry.section = "archive"
  return entry


# ------------------------------------------------------------------------------------------------- output
def render(root: pathlib.Path = ROOT) -> str:
  results = root / "results"
  entries = [describe(results, e) for e in _group(results)]
  lines = [
      "# Results",
      "",
      "Every committed result, generated from the files below by `python tools/results_index.py` (do not edit by",
      "hand: `tests/test_docs.py` checks that this page is the script's output). Each entry gives what the run",
      "measured, the command its file records, the date it records, and one headline number read from its JSON;",
      "the tables, the machine, the caveats and the rest of the numbers are in the files. Sweeps are resumable",
      "stores: a rerun of the command skips finished cells. [`../docs/experiments.md`](../docs/experiments.md)",
      "describes the launchers.",
  ]
  for section, heading in SECTIONS:
    chosen = [e for e in entries if e.section == section]
    if not chosen:
      continue
    lines += ["", f"## {heading}", ""]
    for e in chosen:
      main = next((f for f in e.files if f.endswith(".md")), e.files[0])
      images = [f for f in e.files if f.endswith(".png")]
      others = [f for f in e.files if f != main and not f.endswith(".png")]
      head = f"- **[`{e.key}`]({main})**" + (f": {e.title}" if e.title else "")
      lines.append(head)
      if e.command:
        more = f" (+{e.more_commands} more recorded in the file)" if e.more_commands else ""
        lines.append(f"  - command: `{e.command}`{more}")
      else:
        lines.append("  - command: not recorded in the file")
      if e.date:
        lines.append(f"  - recorded: {e.date}")
      if e.headline:
        lines.append(f"  - headline: {e.headline}")
      if e.key in ARCHIVED:
        lines.append(f"  - archived: {ARCHIVED[e.key]}")
      extra = [f"[`{f.rsplit('/', 1)[-1]}`]({f})" for f in others]
      if images:
        extra.append(f"{len(images)} figure{'s' if len(images) > 1 else ''}")
      if extra:
        lines.append("  - also: " + ", ".join(extra))
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if results/README.md is not up to date")
  args = parser.parse_args(argv)
  text = render()
  path = ROOT / "results" / "README.md"
  if args.check:
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current != text:
      print(f"{path} is out of date: run python tools/results_index.py", file=sys.stderr)
      return 1
    return 0
  path.write_text(text, encoding="utf-8")
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
