"""The stages of the one-GPU check (`experiments/gpu_check.sh` runs each, `python -m experiments.gpu_check
--stage=NAME`, with its own time limit).

Written for the machine as it is lent (../shared/ENVIRONMENT.md): python3 with jax 0.11.x + CUDA, flax, optax,
absl, tokenizers; no ml_collections, gguf or tensorflow-datasets, and no SmolLM2 (what a run carries is at most
64 MiB), so this file and its launcher import none of them (the sizes are here, not in a config file), and every
model is random weights of a real shape made on the device (Llama-3-8B in bf16). Each stage writes
OUTDIR/<stage>.json when it ends (an error is written there too).

Stages:
  smoke       devices; a tiny model's greedy tokens: full = SpeCache (k >= n), offloaded (both host stores) =
              simulated, Pallas (interpret off a GPU) = jnp.
  kernels     pallas_kernels.benchmark: the Pallas kernels vs their float32 references, then (GPU) timed at
              several block sizes with the achieved bandwidth.
  overlap     the offloaded runtime's fetch-hidden fraction (lib/bench/overlap.py) per host store on 8B shapes at
              8k/32k, batch 1/8, and a jax.profiler trace of three pipelined steps (OUTDIR/trace_overlap).
  throughput  decode tok/s of the full cache vs SpeCache 1-bit (offloaded; simulated with the Pallas kernels)
              at the largest batch each fits (the script caps device memory at an A6000's 48 GB).
"""
from __future__ import annotations

import json
import os
import time
import traceback

import jax
import numpy as np

from experiments.lib.bench import models, overlap, states
from experiments.lib.bench.common import RuntimeDriver, random_prompts
from experiments.lib.bench.throughput import make_runner, time_cell
import specache_jax as sj

STAGES = ("smoke", "kernels", "overlap", "throughput")
SPECACHE = dict(bits=1, group_size=64, residual=64, topk=64)


def _sizes(dry: bool) -> dict:
  if dry:
    return dict(model="random:tiny", dtype="float32", cells=[(256, 1), (512, 2)], batches=(4, 2, 1),
                context=512, steps=2, rounds=1, spec=dict(bits=1, group_size=16, residual=16, topk=16))
  return dict(model="random:llama3-8b", dtype="bfloat16", cells=[(8192, 1), (8192, 8), (32768, 1), (32768, 8)],
              batches=(64, 32, 16, 8, 4, 2, 1), context=32768, steps=8, rounds=3, spec=SPECACHE)


def _tiny_prompts(vocab: int, lengths, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


def stage_smoke(dry: bool) -> dict:
  del dry                                                               # the smoke test is tiny everywhere
  model = models.load("random:tiny", "float32", seed=1)
  prompts = _tiny_prompts(model.config.vocab_size, [37, 12, 25])
  kw = dict(max_new_tokens=12, stop_tokens=())
  full = np.asarray(sj.generate(model, prompts, cache=sj.cache_config("full"), **kw).tokens)
  small = dict(bits=1, group_size=8, residual=8)
  out = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__, "checks": {}}
  out["checks"]["specache_k_ge_n_equals_full"] = bool(np.array_equal(
      full, np.asarray(sj.generate(model, prompts, cache=sj.cache_config("specache", topk=64, **small),
                                   **kw).tokens)))
  sim = np.asarray(sj.generate(model, prompts, cache=sj.cache_config("specache", topk=4, **small), **kw).tokens)
  for store in ("pinned_host", "numpy"):
    off = sj.generate(model, prompts, cache=sj.cache_config("specache", topk=4, offload=True, host_store=store,
                                                            **small), **kw)
    out["checks"][f"offload_{store}_equals_simulated"] = bool(np.array_equal(sim, np.asarray(off.tokens)))
  on_gpu = jax.default_backend() == "gpu"
  impl = "pallas" if on_gpu else "pallas_interpret"                   # interpret mode is slow: fewer tokens
  n = kw["max_new_tokens"] if on_gpu else 4
  pal = sj.generate(model, prompts, cache=sj.cache_config("specache", topk=4, attention_impl=impl, **small),
                    max_new_tokens=n, stop_tokens=())
  ref = sim if n == kw["max_new_tokens"] else np.asarray(sj.generate(
      model, prompts, cache=sj.cache_config("specache", topk=4, **small), max_new_tokens=n, stop_tokens=()).tokens)
  out["checks"][f"{impl}_equals_jnp"] = bool(np.array_equal(ref, np.asarray(pal.tokens)))
  out["ok"] = all(out["checks"].values())
  return out


def stage_kernels(dry: bool) -> dict:
  # optional per stage: a Pallas that does not import on this jax fails this stage alone
  from pallas_kernels import benchmark
  return benchmark.run(iters=3 if dry else 20)


def stage_overlap(dry: bool, out_dir: str) -> dict:
  sz = _sizes(dry)
  res = {"cells": []}
  for context, batch in sz["cells"]:
    settings = dict(model=sz["model"], dtype=sz["dtype"], seed=0, method=dict(name="specache", offload=True,
                    **sz["spec"]), context=context, batch=batch, steps=sz["steps"], rounds=sz["rounds"],
                    warmup=2, margin=64, nonspeculative=False, stores=["pinned_host", "numpy"])
    t0 = time.perf_counter()
    try:
      cell = overlap.main_settings(settings)
    except Exception as e:  # a cell that does not fit is recorded, the next one still runs
      cell = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
    cell.update(context=context, batch=batch, seconds=time.perf_counter() - t0)
    res["cells"].append(cell)
    _write(out_dir, "overlap", res)                                     # as it goes
  res["trace"] = _trace_steps(sz, out_dir)
  return res


def _trace_steps(sz: dict, out_dir: str) -> str:
  """A jax.profiler trace of three pipelined offloaded steps (the first cell's shape, numpy store)."""
  context, batch = sz["cells"][0]
  model = models.load(sz["model"], sz["dtype"])
  method = sj.cache_config("specache", offload=True, host_store="numpy", **sz["spec"])
  tokens, lengths = random_prompts(0, batch, context - 64, model.config.vocab_size)
  drv = RuntimeDriver(model, method, batch, context, context - 64)
  carry = drv.prefill(tokens, lengths)
  for _ in range(2):
    carry = drv.step(carry)
  jax.block_until_ready(drv.sync(carry))
  path = os.path.join(out_dir, "trace_overlap")
  with jax.profiler.trace(path):
    for _ in range(3):
      carry = drv.step(carry)
    jax.block_until_ready(drv.sync(carry))
  return path


def stage_throughput(dry: bool) -> dict:
  sz = _sizes(dry)
  model = models.load(sz["model"], sz["dtype"])
  impl = "pallas" if jax.default_backend() == "gpu" else "jnp"
  methods = {"full": sj.cache_config("full"),
             "specache_1bit_offload": sj.cache_config("specache", offload=True, host_store="numpy", **sz["spec"]),
             f"specache_1bit_{impl}": sj.cache_config("specache", attention_impl=impl, **sz["spec"])}
  context = sz["context"]
  res = {"context": context, "device_memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""),
         "methods": {}}
  for label, method in methods.items():
    for batch in sz["batches"]:                                         # the largest batch that fits
      tokens, lengths = random_prompts(batch, batch, context - 64, model.config.vocab_size)
      slots = states.cell_slots(context - 64, 2 + sz["rounds"] * sz["steps"] + 1)
      try:
        runner = make_runner(model, method, tokens, lengths, slots)
        rec = time_cell({label: runner}, 2, sz["steps"], sz["rounds"], batch, model)[label]
        rec.update(batch=batch)
        res["methods"][label] = {k: v for k, v in rec.items() if isinstance(v, (int, float, str, list))}
        break
      except Exception as e:  # out of memory at this batch: try the next smaller one
        res["methods"].setdefault(label, {}).setdefault("refused", []).append(
            f"B={batch}: {type(e).__name__}: {str(e)[:160]}")
      finally:
        runner = None
  return res


def _write(out_dir: str, stage: str, payload: dict) -> None:
  with open(os.path.join(out_dir, f"{stage}.json"), "w") as f:
    json.dump(payload, f, indent=1, default=str)


def run_stage(stage: str, out_dir: str, dry: bool) -> dict:
  """One stage -> OUTDIR/<stage>.json (an error is recorded there too); SystemExit(1) unless its status is ok."""
  os.makedirs(out_dir, exist_ok=True)
  t0 = time.perf_counter()
  payload = {"stage": stage, "dry_run": dry, "backend": jax.default_backend(), "jax": jax.__version__}
  try:
    if stage == "overlap":
      payload.update(stage_overlap(dry, out_dir))
    else:
      payload.update({"smoke": stage_smoke, "kernels": stage_kernels, "throughput": stage_throughput}[stage](dry))
    payload["status"] = "ok" if payload.get("ok", True) else "failed checks"
  except Exception as e:
    payload.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
  payload["seconds"] = time.perf_counter() - t0
  _write(out_dir, stage, payload)
  print(json.dumps({k: payload[k] for k in ("stage", "status", "seconds")}))
  if payload["status"] != "ok":
    raise SystemExit(1)
  return payload
