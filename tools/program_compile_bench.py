"""Trace, lower and XLA-compile seconds of the jitted generation's two programs (`decode.start_jit`,
`decode.loop_jit`) per method, through JAX's ahead-of-time API (nothing runs; the persistent compilation cache
off):

  .venv/bin/python tools/program_compile_bench.py --methods=full,specache1,robust --out=/tmp/programs.json

SmolLM2 by default, batch 1, a 1000-token prompt in a 1024-wide array, a 64-wide output (the default shape
buckets of a (1000, 32) call). Each method in its own process; run it at two commits to compare. The record also
holds the size of the loop's StableHLO text (one layer function called L times, or L inlined layers) and the
compiled loop's instruction, fusion and copy counts (the program XLA runs: equal counts, equal steps).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(model_name: str, name: str) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import specache_jax as sj
  from experiments.lib import models
  from specache_jax import decode

  model = models.load(model_name)
  cfg, params = model.config, model.params
  g = min(64, cfg.head_dim)
  method = {"full": lambda: sj.cache_config("full"),
            "specache1": lambda: sj.cache_config("specache", bits=1, group_size=g, residual=g, topk=g),
            "robust": lambda: sj.cache_config("specache", bits=1, preset="robust", group_size=g),
            "kivi2": lambda: sj.cache_config("kivi", bits=2, group_size=g, residual=g)}[name]()
  toks, lens = jnp.ones((1, 1024), jnp.int32), jnp.array([1000], jnp.int32)
  spec = decode.SamplingSpec.make(0.0, 1.0, (), 0)
  kw = dict(cfg=cfg, method=method)
  max_len = decode.slots_for(1024 + 64, method.speculation.width)
  out = {}

  def timed(key, fn):
    t = time.perf_counter()
    result = fn()
    out[key] = time.perf_counter() - t
    return result

  traced = timed("start_trace_s", lambda: decode.start_jit.trace(params, toks, lens, jax.random.key(0), spec,
                                                                 max_new_tokens=64, max_len=max_len, **kw))
  lowered = timed("start_lower_s", traced.lower)
  timed("start_compile_s", lowered.compile)
  state = traced.out_info
  bound = (jnp.int32(32),) if "new_tokens" in inspect.signature(decode.loop_jit).parameters else ()  # older loops
  traced = timed("loop_trace_s", lambda: decode.loop_jit.trace(params, state, spec, *bound, **kw))
  lowered = timed("loop_lower_s", traced.lower)
  out["loop_stablehlo_chars"] = len(lowered.as_text())
  compiled = timed("loop_compile_s", lowered.compile)
  ops = collections.Counter(re.findall(r"= [^=]*? ([a-z][a-z0-9-]*)\(", compiled.as_text()))
  out.update(loop_hlo_instructions=sum(ops.values()), loop_hlo_fusions=ops["fusion"], loop_hlo_copies=ops["copy"])
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--methods", default="full,specache1,robust")
  ap.add_argument("--out")
  ap.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"))
  args = ap.parse_args()
  if args.child:
    print(json.dumps(_child(*args.child)))
    return
  if not args.out:
    ap.error("--out is required")
  env = dict(os.environ, SPECACHE_JAX_COMPILE_CACHE="0", JAX_PLATFORMS="cpu")
  from experiments.lib.report import code_commit
  commit = code_commit()
  record = dict(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", commit=commit,
                command=" ".join([".venv/bin/python", "tools/program_compile_bench.py"] + sys.argv[1:]),
                cpus=os.cpu_count(), load_start=os.getloadavg()[0], model=args.model, methods={})
  for name in args.methods.split(","):
    done = subprocess.run([sys.executable, __file__, "--child", args.model, name], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    record["methods"][name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(name, {k: round(v, 2) for k, v in record["methods"][name].items()}, flush=True)
  record["load_end"] = os.getloadavg()[0]
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))         # this checkout's code, not an installed one
  main()
