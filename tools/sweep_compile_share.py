"""The compile share of a sweep: its wall time and the seconds JAX spent tracing, lowering and compiling in it.

  .venv/bin/python tools/sweep_compile_share.py --sweep=niah --config=configs/niah.py --out=/tmp/share.json
  .venv/bin/python tools/sweep_compile_share.py --sweep=ruler --config=configs/ruler.py:test --out=/tmp/s.json
  .venv/bin/python tools/sweep_compile_share.py --table=results/compile_share     # summary.md of its records

Runs the sweep's `run` in this process, into a fresh output folder (every cell computed; the persistent
compilation cache off, so every program is compiled, unless `--compile_cache=FOLDER` names one: run twice with
the same folder for a warm second run), under `clock.CompileLog`, and writes one JSON record:
wall seconds, the union of each kind's spans (trace / lower / XLA compile) and of all three, the programs
compiled, the cells computed, with the date, commit, load average and command. Run it at two commits to compare.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table(folder: Path) -> None:
  """summary.md: one row per record (*.json) in the folder."""
  lines = ["# The compile share of sweeps", "",
           "Each row: one run of `tools/sweep_compile_share.py` (its command and commit in the row), every cell "
           "computed in one process; `compile s`: the union of JAX's trace, lower and XLA-compile spans; "
           "`programs`: XLA compilations (or read-backs, with a warm folder). The load average moved between "
           "runs (2 CPUs shared with other jobs): compare the compile seconds more than the wall seconds.", "",
           "| record | commit | date | load | wall s | compile s | share | trace s | lower s | XLA s | programs "
           "| cells | command |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  records = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
  programs = {k: r for k, r in records.items() if "methods" in r}       # tools/program_compile_bench.py's
  for stem, r in records.items():
    if stem in programs:
      continue
    lines.append(f"| {stem} | {r['commit']} | {r['date']} | {r['load_start']:.1f}-{r['load_end']:.1f} "
                 f"| {r['wall_s']:.0f} | {r['all_compile_s']:.0f} | {r['compile_share']:.0%} | {r['trace_s']:.0f} "
                 f"| {r['lower_s']:.0f} | {r['compile_s']:.0f} | {r['programs']} | {r['cells']} | `{r['command']}` |")
  if programs:
    lines += ["", "## The two programs of a generation, per method (`tools/program_compile_bench.py`)", "",
              "SmolLM2, batch 1, a (1000, 32) call's shapes; seconds through JAX's ahead-of-time API, nothing run.",
              "", "| record | commit | date | load | method | start trace / lower / XLA s "
              "| loop trace / lower / XLA s | loop StableHLO kchars | compiled loop: instructions / fusions / copies |",
              "|---|---|---|---|---|---|---|---:|---|"]
    for stem, r in programs.items():
      for name, m in r["methods"].items():
        lines.append(f"| {stem} | {r['commit']} | {r['date']} | {r['load_start']:.1f}-{r['load_end']:.1f} "
                     f"| {name} | {m['start_trace_s']:.1f} / {m['start_lower_s']:.1f} / {m['start_compile_s']:.1f} "
                     f"| {m['loop_trace_s']:.1f} / {m['loop_lower_s']:.1f} / {m['loop_compile_s']:.1f} "
                     f"| {m['loop_stablehlo_chars'] // 1000} | {m.get('loop_hlo_instructions', '–')} / "
                     f"{m.get('loop_hlo_fusions', '–')} / {m.get('loop_hlo_copies', '–')} |")
    lines.append(f"\nCommands: " + "; ".join(f"`{r['command']}` ({r['commit']})" for r in programs.values()))
  (folder / "summary.md").write_text("\n".join(lines) + "\n")
  print("wrote", folder / "summary.md")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--table", help="write summary.md of the records in this folder and exit")
  ap.add_argument("--sweep", choices=("niah", "ruler", "perplexity"))
  ap.add_argument("--config", help="a config file, e.g. configs/niah.py or configs/ruler.py:test")
  ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE overrides (strings), repeatable")
  ap.add_argument("--compile_cache", default="0", help="the persistent compilation cache's folder; 0: off")
  ap.add_argument("--out")
  args = ap.parse_args()
  if args.table:
    table(Path(args.table))
    return
  if not (args.sweep and args.config and args.out):
    ap.error("--sweep, --config and --out are required (or --table)")
  os.environ["SPECACHE_JAX_COMPILE_CACHE"] = args.compile_cache
  import jax
  from specache_jax import clock
  path, _, variant = args.config.partition(":")
  spec = importlib.util.spec_from_file_location("sweep_config", ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant) if variant else module.get_config()
  for item in args.set:
    field, _, value = item.partition("=")
    config[field] = type(config[field])(value)
  sweep = importlib.import_module(f"experiments.lib.{args.sweep}")
  load_start = os.getloadavg()[0]
  with tempfile.TemporaryDirectory(prefix="specache_share_") as tmp:
    config.output_dir = tmp
    with clock.CompileLog() as log:
      t0 = time.time()
      result = sweep.run(config, log=lambda *a, **k: None)
      wall = time.time() - t0
  kinds = {k: clock.union_seconds([(s, e) for kind, s, e in log.spans if kind == k]) for k in
           ("trace", "lower", "compile")}
  from experiments.lib.report import code_commit
  commit = code_commit()
  record = dict(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", commit=commit,
                command=" ".join([".venv/bin/python", "tools/sweep_compile_share.py"] + sys.argv[1:]),
                cpus=os.cpu_count(), load_start=load_start, load_end=os.getloadavg()[0], jax=jax.__version__,
                wall_s=wall, compile_share=log.seconds() / wall, all_compile_s=log.seconds(),
                programs=log.count("compile"), cells=getattr(result, "computed", None),
                **{f"{k}_s": v for k, v in kinds.items()})
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
  print(json.dumps(record))


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))         # this checkout's code, not an installed one
  main()
