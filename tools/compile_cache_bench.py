"""A fresh process's first `sj.generate` with an empty vs a warm persistent compilation cache
(specache_jax.compile_cache), per model and method:

  .venv/bin/python tools/compile_cache_bench.py --out=results/compile_cache_cpu.md
  .venv/bin/python tools/compile_cache_bench.py --models=tiny --methods=full --out=/tmp/cc.md      # smoke

For each (model, method) a new empty cache folder, then one process after another, each timing its first call
(prompt `--prompt` random tokens, `--new` new tokens, greedy, batch 1): `off` (SPECACHE_JAX_COMPILE_CACHE=0),
`empty` (the folder fresh), `warm` (the folder as `empty` left it), `--repeats` times, the fastest of each kept.
The tokens of all must agree (a cache that changed them would be wrong, not slow). Each process also reports
JAX's compile events: programs compiled by XLA, entries read back, XLA's seconds for both, and the seconds of
tracing and lowering (which no persistent cache saves). Times are wall seconds of the call, the model loaded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"tiny": "random:tiny", "smollm2": "smollm2-135m"}
METHODS = ("full", "specache1", "robust")


def _child(model: str, method: str, prompt: int, new: int) -> dict:
  """Runs in the timed process: loads, calls generate once -> the call's seconds, tokens and compile events."""
  t_import = time.perf_counter()
  import jax
  import numpy as np

  import specache_jax as sj
  from specache_jax import compile_cache
  from experiments.lib.bench import models as bench_models
  t_import = time.perf_counter() - t_import

  events = {"programs": 0, "read_back": 0, "compile_s": 0.0, "trace_lower_s": 0.0}

  def on_event(name, **_):
    if name == "/jax/compilation_cache/cache_hits":
      events["read_back"] += 1

  def on_duration(name, secs, **_):
    if name == "/jax/core/compile/backend_compile_duration":
      events["programs"] += 1            # compiled, or read back from the cache folder
      events["compile_s"] += secs
    elif name in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration"):
      events["trace_lower_s"] += secs    # what no persistent cache saves

  jax.monitoring.register_event_listener(on_event)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  lm = bench_models.load(MODELS[model])
  g = min(64, lm.config.head_dim)           # the tiny model's head_dim is 16
  if method == "full":
    cache = sj.cache_config("full")
  elif method == "robust":
    cache = sj.cache_config("specache", bits=1, preset="robust", group_size=g)
  else:
    cache = sj.cache_config("specache", bits=1, group_size=g, residual=g, topk=g)
  tokens = np.random.RandomState(0).randint(0, lm.config.vocab_size, size=(1, prompt)).astype(np.int32)
  before = dict(events)
  t0 = time.perf_counter()
  out = sj.generate(lm, tokens, max_new_tokens=new, cache=cache, stop_tokens=())
  toks = np.asarray(jax.block_until_ready(out.tokens))
  seconds = time.perf_counter() - t0
  counts = {k: events[k] - before[k] for k in events}
  again = np.random.RandomState(1).randint(0, lm.config.vocab_size, size=(1, prompt)).astype(np.int32)
  t0 = time.perf_counter()                  # the same lengths again in this process: nothing to compile
  jax.block_until_ready(sj.generate(lm, again, max_new_tokens=new, cache=cache, stop_tokens=()).tokens)
  warm_call_s = time.perf_counter() - t0
  return dict(seconds=seconds, warm_call_s=warm_call_s, import_s=t_import, tokens=toks[0].tolist(), cache=compile_cache.status(),
              compiled=counts["programs"] - counts["read_back"], **counts)


def _run(model: str, method: str, prompt: int, new: int, cache_setting: str) -> dict:
  env = dict(os.environ, SPECACHE_JAX_COMPILE_CACHE=cache_setting, JAX_PLATFORMS="cpu")
  for name in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS"):       # the library's own defaults, nothing inherited
    env.pop(name, None)
  cmd = [sys.executable, __file__, "--child", model, method, str(prompt), str(new)]
  t0 = time.perf_counter()
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if done.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
  result = json.loads(done.stdout.strip().splitlines()[-1])
  result["process_s"] = time.perf_counter() - t0
  return result


def _folder_mib(folder: Path) -> float:
  return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 2**20


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default="tiny,smollm2")
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--prompt", type=int, default=1000)
  ap.add_argument("--new", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=2, help="processes per (row, setting); the fastest is reported")
  ap.add_argument("--out", default="results/compile_cache_cpu.md")
  ap.add_argument("--child", nargs=4, metavar=("MODEL", "METHOD", "PROMPT", "NEW"))
  args = ap.parse_args()
  if args.child:
    model, method, prompt, new = args.child
    print(json.dumps(_child(model, method, int(prompt), int(new))))
    return
  load_start = os.getloadavg()[0]
  rows = []
  for model in args.models.split(","):
    for method in args.methods.split(","):
      tries = {"off": [], "empty": [], "warm": []}
      for _ in range(args.repeats):                   # interleaved, so that a burst of load hits every setting
        tries["off"].append(_run(model, method, args.prompt, args.new, "0"))
        with tempfile.TemporaryDirectory(prefix="specache_cc_") as tmp:
          tries["empty"].append(_run(model, method, args.prompt, args.new, tmp))
          tries["warm"].append(_run(model, method, args.prompt, args.new, tmp))
          mib = _folder_mib(Path(tmp))
      if len({tuple(r["tokens"]) for rs in tries.values() for r in rs}) != 1:
        raise AssertionError(f"{model} {method}: the tokens differ between off/empty/warm: {tries}")
      runs = {k: min(rs, key=lambda r: r["seconds"]) for k, rs in tries.items()}
      rows.append((model, method, runs, mib))
      print(model, method, {k: round(v["seconds"], 2) for k, v in runs.items()}, f"{mib:.1f} MiB", flush=True)
  from experiments.lib.report import code_commit      # imported here: the parent needs jax for nothing else
  commit = code_commit()
  lines = [
      "# A fresh process's first `sj.generate`: persistent compilation cache off, empty, warm",
      "",
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
      f"{os.cpu_count()} CPUs (load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), "
      "command: "
      f"`.venv/bin/python tools/compile_cache_bench.py " + " ".join(sys.argv[1:]) + "`",
      "",
      f"Batch 1, greedy, a random {args.prompt}-token prompt, {args.new} new tokens; the library's defaults "
      "(XLA's default optimization level; CPU kernels on). `s`: the first call's wall time in a new process (the "
      f"model loaded), the fastest of {args.repeats} processes; `compiled`: programs XLA compiled during the call; "
      "`read`: programs read back from the cache folder; `XLA s`: the seconds of both (JAX's backend-compile "
      "events); `trace+lower s`: tracing to a jaxpr and lowering to StableHLO (JAX's events), which a persistent "
      "cache does not save; `warm call s`: a second call at the same lengths in the warm process (of the warm "
      "setting's fastest process), and `warm / call`: the first call with a warm folder over it. Every process of "
      "a row gave the same tokens. The machine is shared (load average "
      "above): compare within a row.",
      "",
      "| model | method | off s | empty s | warm s | warm / empty | compiled (empty → warm) | read (warm) "
      "| XLA s (empty → warm) | trace+lower s (warm) | folder MiB | warm call s | warm / call |",
      "|---|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|",
  ]
  for model, method, runs, mib in rows:
    off, empty, warm = runs["off"], runs["empty"], runs["warm"]
    lines.append(f"| {model} | {method} | {off['seconds']:.2f} | {empty['seconds']:.2f} | {warm['seconds']:.2f} "
                 f"| {warm['seconds'] / empty['seconds']:.2f} | {empty['compiled']} → {warm['compiled']} "
                 f"| {warm['read_back']} | {empty['compile_s']:.1f} → {warm['compile_s']:.1f} "
                 f"| {warm['trace_lower_s']:.1f} | {mib:.1f} | {warm['warm_call_s']:.2f} "
                 f"| {warm['seconds'] / warm['warm_call_s']:.2f} |")
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text("\n".join(lines) + "\n")
  print("wrote", args.out)


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))         # this checkout's specache_jax, not an installed one
  main()
