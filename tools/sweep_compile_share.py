"""The compile share of a sweep: its wall time and the seconds JAX spent tracing, lowering and compiling in it.

  .venv/bin/python tools/sweep_compile_share.py --sweep=niah --config=configs/niah.py --out=/tmp/share.json
  .venv/bin/python tools/sweep_compile_share.py --sweep=ruler --config=configs/ruler.py:test --out=/tmp/s.json

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sweep", required=True, choices=("niah", "ruler", "perplexity"))
  ap.add_argument("--config", required=True, help="a config file, e.g. configs/niah.py or configs/ruler.py:test")
  ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE overrides (strings), repeatable")
  ap.add_argument("--compile_cache", default="0", help="the persistent compilation cache's folder; 0: off")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
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
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
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
