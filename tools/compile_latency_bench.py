"""Compilation per `sj.generate` call in one process, with shape buckets (`buckets.DEFAULT`) and without
(`buckets=None`: programs compiled for the exact lengths), per method:

  .venv/bin/python tools/compile_latency_bench.py --out=results/compile_latency_cpu.md
  .venv/bin/python tools/compile_latency_bench.py --model=tiny --methods=full --out=/tmp/cl.md      # smoke

Each (method, policy) runs in a new process with the persistent compilation cache off (so every program is
compiled, not read back), the processes of a method one after the other (exact, bucketed). A process makes the
calls of `--calls` in order (prompt tokens x new tokens; batch 1, greedy, a fresh random prompt each) and
reports, per call, its wall seconds, the compile events' seconds by kind (trace, lower, XLA compile: JAX's
monitoring spans, `clock.CompileLog`), the programs compiled, the time to first token and the decode step time
(1 / decode tokens per second). The prefill's padding cost is the warm call's time to first token, bucketed
(the prompt padded to its bucket) against exact.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"tiny": "random:tiny", "smollm2": "smollm2-135m"}
METHODS = ("full", "specache1", "robust", "specache1_offloaded", "robust_offloaded")
CALLS = "1000x32,1000x32,1010x32,1020x40,1000x64"


def _method(name: str, head_dim: int):
  import specache_jax as sj
  g = min(64, head_dim)
  if name == "full":
    return sj.cache_config("full")
  if name in ("robust", "robust_offloaded"):
    return sj.cache_config("specache", bits=1, preset="robust", group_size=g, offload=name.endswith("offloaded"))
  if name in ("specache1", "specache1_offloaded"):
    return sj.cache_config("specache", bits=1, group_size=g, residual=g, topk=g,
                           offload=name.endswith("offloaded"))
  raise ValueError(f"method={name!r} must be one of {METHODS}")


def _child(model: str, method: str, policy: str, calls: str) -> dict:
  import jax
  import numpy as np

  import specache_jax as sj
  from experiments.lib.bench import models as bench_models
  from specache_jax import buckets, clock

  lm = bench_models.load(MODELS[model])
  cache = _method(method, lm.config.head_dim)
  rows = []
  for i, call in enumerate(calls.split(",")):
    prompt, new = (int(x) for x in call.split("x"))
    tokens = np.random.RandomState(i).randint(0, lm.config.vocab_size, size=(1, prompt)).astype(np.int32)
    with clock.CompileLog() as log:
      t0 = time.perf_counter()
      out, stats = sj.generate(lm, tokens, max_new_tokens=new, cache=cache, stop_tokens=(), return_stats=True,
                               buckets=buckets.DEFAULT if policy == "bucketed" else None)
      jax.block_until_ready(out.tokens)
      wall = time.perf_counter() - t0
    kinds = {k: clock.union_seconds([(s, e) for kind, s, e in log.spans if kind == k])
             for k in ("trace", "lower", "compile")}
    rows.append(dict(call=call, wall_s=wall, compilations=log.count("compile"), ttft_s=stats["ttft_s"],
                     step_ms=1e3 / stats["decode_tokens_per_s"], tokens=np.asarray(out.tokens)[0].tolist(),
                     **{f"{k}_s": v for k, v in kinds.items()}))
  return dict(rows=rows)


def _run(model: str, method: str, policy: str, calls: str) -> dict:
  env = dict(os.environ, SPECACHE_JAX_COMPILE_CACHE="0", JAX_PLATFORMS="cpu")
  cmd = [sys.executable, __file__, "--child", model, method, policy, calls]
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if done.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--calls", default=CALLS, help="PROMPTxNEW,... made in order in one process")
  ap.add_argument("--policies", default="exact,bucketed", help="exact (buckets=None), bucketed (the default)")
  ap.add_argument("--out", default="results/compile_latency_cpu.md")
  ap.add_argument("--child", nargs=4, metavar=("MODEL", "METHOD", "POLICY", "CALLS"))
  args = ap.parse_args()
  if args.child:
    print(json.dumps(_child(*args.child)))
    return
  load_start = os.getloadavg()[0]
  results = []
  for method in args.methods.split(","):
    runs = {policy: _run(args.model, method, policy, args.calls) for policy in args.policies.split(",")}
    for a, *others in zip(*(run["rows"] for run in runs.values())):
      if any(a["tokens"] != b["tokens"] for b in others):
        raise AssertionError(f"{method} {a['call']}: the bucketed tokens differ from the exact ones")
    results.append((method, runs))
    for policy, run in runs.items():
      print(method, policy, [(r["call"], round(r["wall_s"], 2), r["compilations"]) for r in run["rows"]],
            flush=True)
    _write(args, results, load_start)                 # after each method: a long run keeps what it measured


def _write(args, results, load_start) -> None:
  from experiments.lib.report import code_commit      # imported here: the parent needs jax for nothing else
  commit = code_commit()
  lines = [
      "# Compilation per `sj.generate` call: exact shapes vs shape buckets",
      "",
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
      f"{os.cpu_count()} CPUs (load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), "
      f"model {args.model}, command: `.venv/bin/python tools/compile_latency_bench.py "
      + " ".join(sys.argv[1:]) + "`",
      "",
      "One process per (method, policy), the persistent compilation cache off, the calls in the order listed "
      "(batch 1, greedy, a fresh random prompt each; `PROMPTxNEW`). `exact`: `buckets=None` (programs for the "
      "exact lengths: the prompt rounded to 16, the output width = max_new_tokens); `bucketed`: "
      "`buckets.DEFAULT`. trace / lower / XLA s: the union of JAX's compile-event spans of each kind during the "
      "call; `programs`: XLA compilations; step ms: 1 / decode tokens per second; `x warm`: the call's wall "
      "time over the second call's (the first call's lengths again, nothing to compile). Where both policies "
      "ran, their tokens agree call by call. The machine is shared (load average above): compare within a "
      "method.",
      "",
      "| method | call | policy | wall s | x warm | programs | trace s | lower s | XLA s | ttft s | step ms |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for method, runs in results:
    for i in range(len(next(iter(runs.values()))["rows"])):
      for policy, run in runs.items():
        r = run["rows"][i]
        warm = run["rows"][1]["wall_s"] if len(run["rows"]) > 1 else float("nan")
        lines.append(f"| {method} | {r['call']}{' (first)' if i == 0 else ''} | {policy} | {r['wall_s']:.2f} "
                     f"| {r['wall_s'] / warm:.2f} "
                     f"| {r['compilations']} | {r['trace_s']:.2f} | {r['lower_s']:.2f} | {r['compile_s']:.2f} "
                     f"| {r['ttft_s']:.3f} | {r['step_ms']:.1f} |")
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text("\n".join(lines) + "\n")
  print("wrote", args.out)


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))         # this checkout's specache_jax, not an installed one
  main()
