"""How much of the κ fetch the offloaded runtime hides behind compute.

On one prefilled offloaded SpeCache runtime, in alternating rounds of `steps` decoding steps each:
  (a) compute alone: the same runtime step and programs, every fetch answered by a block of rows fetched once
      and held on the device (no host gather, no transfer, no wait for them; the rows are still installed) —
      ring-flush writes to the host still run;
  (b) fetch alone: every layer group's host gather + `device_put` of κ, issued together and blocked on;
  (c) the pipelined step: the runtime as it is (κ_{t+1} issued right after each layer group).
fraction hidden = (a + b - c) / b per round (a and c back to back, in alternating order), the median over rounds,
clipped to [0, 1] (the raw value is kept too), with a 90% bootstrap interval of that median: b is a few % of a
step here, so a shared machine's round-to-round noise in a and c moves the fraction by much more than b. Also
measured: the time the dispatching thread spends just issuing (b) — that part sits on the step's critical path
whatever the transfer does — and the CPU time that thread spends per pipelined step (`time.thread_time`:
dispatching the per-group programs and issuing the fetches, not its waits), reported per layer. Each host store
configured is measured separately. With `generate_tokens` set, `generate_loop` also times the runtime's own
`generate` loop (stop checks included) per `sync_every` value, with the host reads per step it counts. On a CPU the overlap only shows with XLA computing on one core and the host
store's worker on another, so `run_configured` measures in a subprocess with XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1" (ENVIRONMENT.md) whose XLA threads are pinned to one CPU (`pin_xla_threads`):
those flags alone keep each op on one thread, but XLA:CPU's thunk executor still ran independent ops on a second
thread (a profile showed two XLA threads each busy ~35 ms of an ~80 ms step), leaving the worker no core.

  python -m experiments.lib.bench.overlap '<json settings>'    # the subprocess entry: prints one JSON line
"""
from __future__ import annotations

import dataclasses
import glob
import inspect
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from experiments.lib.bench import models, states, timing
from experiments.lib.bench.common import RuntimeDriver, random_prompts
from specache_jax.arrays import Ready
from specache_jax.caches import cache_config
from specache_jax.runtime import OffloadRuntime

SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
CHECKOUT = pathlib.Path(__file__).resolve().parents[3]     # the harness runs from here


def pin_xla_threads() -> set[int]:
  """Create the CPU backend with this thread pinned to one CPU, then unpin it: XLA's threads (created with the
  client, inheriting the affinity) stay on that CPU, and threads started later (the host store's worker) may use
  every CPU. Must run before anything initialises the backend. Linux only. -> the CPU XLA keeps."""
  cpus = os.sched_getaffinity(0)
  one = {min(cpus)}
  os.sched_setaffinity(0, one)
  try:
    jax.devices()
  finally:
    os.sched_setaffinity(0, cpus)
  return one


def xla_thread_cpus() -> list[str]:
  """The CPU lists (Linux's Cpus_allowed_list) of this process's XLA threads (named tf_XLA*), deduplicated."""
  found = set()
  for task in glob.glob("/proc/self/task/*"):
    try:
      with open(f"{task}/comm") as f:
        if not f.read().startswith("tf_XLA"):
          continue
      with open(f"{task}/status") as f:
        found.update(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
    except OSError:                 # the thread ended meanwhile
      continue
  return sorted(found)


class ResidentStore:
  """Wraps a host store: `fetch` answers with a block of rows fetched once per layer group and held on the
  device (`held`: {layers: what the store's fetch gave}), so the runtime runs the pipelined step's own programs,
  rows installed, without the host gather, the transfer and the wait for them; writes go to the real store."""

  def __init__(self, store, held: dict):
    self._store = store
    self._held = held
    self.kind = store.kind

  @classmethod
  def holding_current_rows(cls, rt):
    """A ResidentStore over `rt.store` holding the rows of each group's current κ (fetched now, waited on)."""
    return cls(rt.store, {tuple(g): p.result() for g, p in zip(rt.groups, issue_all_layers(rt))})

  def fetch(self, layers, kappas_BKX):
    del kappas_BKX
    return Ready(self._held[tuple(layers)])

  def __getattr__(self, name):
    return getattr(self._store, name)


def issue_all_layers(rt):
  """Issue every layer group's κ gather + device_put (returns the pending fetches without waiting)."""
  return [rt.store.fetch(layers, tuple(rt.states[l].kappa for l in layers)) for layers in rt.groups]


def fetch_all_layers(rt):
  """(b): issue every layer's κ gather + device_put, then block on all of them."""
  return timing.block([p.result() for p in issue_all_layers(rt)])


def issue_seconds(rt, n: int) -> float:
  """Mean seconds the calling thread spends issuing all layers' fetches (the part no overlap can hide:
  it runs on the thread that dispatches the step)."""
  total = 0.0
  for _ in range(n):
    t0 = time.perf_counter()
    pending = issue_all_layers(rt)
    total += time.perf_counter() - t0
    timing.block([p.result() for p in pending])
  return total / n


def dispatch_cpu_seconds(drv, carry, n: int):
  """(mean CPU seconds the calling thread spends inside one pipelined `drv.step`, carry): what the runtime's
  per-layer dispatch costs the dispatching thread (its waits for fetches or results do not count)."""
  total = 0.0
  for _ in range(n):
    c0 = time.thread_time()
    carry = drv.step(carry)
    total += time.thread_time() - c0
  timing.block(drv.sync(carry))
  return total / n, carry


def measure(model, method, context: int, batch: int, steps: int, rounds: int, warmup: int, margin: int,
            seed: int) -> dict:
  """Medians over `rounds` of (a), (b), (c), each the mean over `steps` steps; method must be offloaded."""
  if not (method.offload and method.speculation.width > 1):   # pre-decoding on or off: only step 1 differs
    raise ValueError(f"the overlap measurement needs an offloaded speculative SpeCache config (offload=True, "
                     f"speculative=True); got {method!r}")
  prompt_len = context - margin
  total = warmup + 1 + 2 + rounds * 3 * steps            # (c), the dispatch-CPU steps and (a) per round
  tokens, lengths = random_prompts(seed + context, batch, prompt_len, model.config.vocab_size)
  drv = RuntimeDriver(model, method, batch, states.cell_slots(prompt_len, total), prompt_len)
  carry = drv.prefill(tokens, lengths)
  _, carry = timing.time_chain(drv.step, carry, warmup, 1, sync=drv.sync)
  rt, real = drv.rt, drv.rt.store
  resident = ResidentStore.holding_current_rows(rt)

  def resident_steps(carry, n):
    rt.store = resident
    try:
      return timing.time_chain(drv.step, carry, 0, n, sync=drv.sync)
    finally:
      rt.store = real

  _, carry = resident_steps(carry, 2)                     # untimed: any compile the (a) variant triggers
  fetch_all_layers(rt)
  a, b, c, d, e = [], [], [], [], []
  for r in range(rounds):
    if r % 2:                                             # a c c a ...: a linear drift cancels in pairs
      sec, carry = resident_steps(carry, steps)
      a.append(sec)
    sec, carry = timing.time_chain(drv.step, carry, 0, steps, sync=drv.sync)
    c.append(sec)
    if not r % 2:
      sec, carry = resident_steps(carry, steps)
      a.append(sec)
    sec, carry = dispatch_cpu_seconds(drv, carry, steps)
    e.append(sec)
    b.append(timing.time_calls(lambda: fetch_all_layers(rt), 0, steps)["mean_s"])
    d.append(issue_seconds(rt, steps))
  ma, mb, mc = statistics.median(a), statistics.median(b), statistics.median(c)
  # per round, from that round's own (a), (b), (c) (measured back to back: a shared machine's slow drift cancels),
  # then the median over rounds, with its spread: b is a few % of a step, so a round's noise moves the fraction
  per_round = [(ai + bi - ci) / bi if bi > 0 else float("nan") for ai, bi, ci in zip(a, b, c)]
  raw = statistics.median(per_round)
  n_layers = model.config.n_layers
  return {"context": context, "batch": batch, "store": real.kind, "steps": steps, "rounds": rounds,
          "compute_alone_s": ma, "fetch_alone_s": mb, "pipelined_s": mc, "fetch_issue_s": statistics.median(d),
          "dispatch_cpu_s": statistics.median(e), "n_layers": n_layers,
          "dispatch_cpu_us_per_layer": statistics.median(e) / n_layers * 1e6,
          "rounds_s": {"compute_alone": a, "fetch_alone": b, "pipelined": c, "fetch_issue": d, "dispatch_cpu": e},
          "fraction_hidden_raw": raw, "fraction_hidden": min(max(raw, 0.0), 1.0),
          "fraction_hidden_ci90": median_interval(per_round),
          "pipelined_minus_compute_s": statistics.median([ci - ai for ai, ci in zip(a, c)]),
          "pipelined_minus_compute_ci90_s": median_interval([ci - ai for ai, ci in zip(a, c)]),
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "load_average_1_5_15": timing.load_average()}


def median_interval(values, level: float = 0.9, resamples: int = 2000) -> list[float]:
  """A bootstrap interval of the median of `values` ([lo, hi] at `level`; seeded: the same values give the same
  interval)."""
  x = np.asarray(values, float)
  if x.size < 2 or not np.isfinite(x).all():
    return [float("nan"), float("nan")]
  meds = np.median(np.random.default_rng(0).choice(x, (resamples, x.size)), axis=1)
  return [float(np.quantile(meds, (1 - level) / 2)), float(np.quantile(meds, (1 + level) / 2))]


def nonspeculative_step(model, method, context, batch, steps, warmup, margin, seed) -> float:
  """Seconds per step of the non-speculative ablation (fetch on the critical path), same settings."""
  # predecode is an option of the speculative decoder only (the non-speculative one has no pass to turn off)
  ns = dataclasses.replace(method, speculation=dataclasses.replace(method.speculation, speculative=False,
                                                                    predecode=True))
  prompt_len = context - margin
  tokens, lengths = random_prompts(seed + context, batch, prompt_len, model.config.vocab_size)
  drv = RuntimeDriver(model, ns, batch, states.cell_slots(prompt_len, warmup + steps + 2), prompt_len)
  sec, _ = timing.time_chain(drv.step, drv.prefill(tokens, lengths), warmup, steps, sync=drv.sync)
  return sec


def generate_loop(model, method, context: int, batch: int, tokens: int, repeats: int, margin: int, seed: int,
                  sync_every: int | None = None) -> dict:
  """`OffloadRuntime.generate`'s decoding loop as it runs (its stop checks included; no stop token, so every
  step runs): seconds and dispatching-thread CPU (`time.thread_time`) per decoding step, from the medians over
  `repeats` runs of `tokens` and of 2 new tokens (their difference is tokens - 2 steps; prefill and compiles
  cancel); the runtime's host reads per step (`host_reads`, where the runtime counts them). sync_every: the
  runtime's setting (None: its default; ignored by a runtime without it)."""
  prompt_len = context - margin
  toks, lens = random_prompts(seed + context, batch, prompt_len, model.config.vocab_size)
  kw = {} if sync_every is None or "sync_every" not in inspect.signature(OffloadRuntime).parameters \
      else {"sync_every": sync_every}
  rt = OffloadRuntime(model.params, model.config, method, batch, states.cell_slots(prompt_len, tokens),
                      prompt_len=prompt_len, **kw)

  def run(n):
    reads = getattr(rt, "host_reads", None)
    t0, c0 = time.perf_counter(), time.thread_time()
    timing.block(rt.generate(toks, lens, n, jax.random.key(seed), stop_tokens=()).tokens)
    return (time.perf_counter() - t0, time.thread_time() - c0,
            None if reads is None else rt.host_reads - reads)

  run(tokens), run(2)                                      # compiles
  long, short = [run(tokens) for _ in range(repeats)], [run(2) for _ in range(repeats)]
  steps = tokens - 2
  per = lambda i: (statistics.median(r[i] for r in long) - statistics.median(r[i] for r in short)) / steps
  reads = None if long[0][2] is None else (long[0][2] - short[0][2]) / steps
  return {"sync_every": getattr(rt, "sync_every", None), "tokens": tokens, "repeats": repeats,
          "step_s": per(0), "dispatch_cpu_s": per(1), "dispatch_cpu_us_per_layer": per(1) / model.config.n_layers * 1e6,
          "host_reads_per_step": reads, "store": rt.store.kind}


def main_settings(settings: dict) -> dict:
  """Everything from JSON-ready settings (what the subprocess receives)."""
  model = models.load(settings["model"], settings.get("dtype", ""), settings.get("seed", 0))
  spec = dict(settings["method"])
  method = cache_config(spec.pop("name"), **spec)
  kw = {k: settings[k] for k in ("context", "batch", "steps", "warmup", "margin", "seed")}
  out = {"model": model.source, "method": settings["method"], "stores": {},
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
  for store in settings.get("stores") or [method.host_store]:
    m = dataclasses.replace(method, host_store=store)
    out["stores"][store] = measure(model, m, rounds=settings["rounds"], **kw)
  if settings.get("generate_tokens"):
    out["generate_loop"] = [
        generate_loop(model, method, settings["context"], settings["batch"], settings["generate_tokens"],
                      settings.get("generate_repeats", 5), settings["margin"], settings["seed"], every)
        for every in settings.get("sync_every") or [None]]
  if settings.get("nonspeculative"):
    out["nonspeculative_step_s"] = nonspeculative_step(model, method, **kw)
  return out


def run_subprocess(settings: dict, single_thread: bool, timeout_s: float) -> dict:
  """`main_settings` in a fresh Python (optionally single-threaded XLA); returns its JSON or {skipped}."""
  env = dict(os.environ)             # the harness is imported from the checkout, whatever the working directory
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH", "")) if p)
  if single_thread:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + SINGLE_THREAD_XLA).strip()
  cmd = [sys.executable, "-m", "experiments.lib.bench.overlap", json.dumps(settings)]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return {"skipped": f"the overlap subprocess ran past {timeout_s:.0f} s"}
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    return {"skipped": f"the overlap subprocess failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}"}
  out = json.loads(lines[-1])
  out["subprocess_s"] = time.perf_counter() - t0
  return out


def run_configured(config, log=print) -> dict:
  """The overlap measurement as `config.overlap` describes it (in a subprocess when asked)."""
  o = config.overlap
  method = dict(o.method.to_dict() if hasattr(o.method, "to_dict") else o.method)
  settings = dict(model=config.model, dtype=config.dtype, seed=config.seed, method=method, context=o.context,
                  batch=o.batch, steps=o.steps, rounds=o.rounds, warmup=o.warmup, margin=config.margin,
                  nonspeculative=o.nonspeculative, stores=list(o.stores))
  log(f"overlap: {settings}")
  if o.subprocess:
    single = o.single_thread_xla and jax.default_backend() == "cpu"
    return run_subprocess(dict(settings, pin_xla=single and hasattr(os, "sched_setaffinity")), single, o.timeout_s)
  return main_settings(settings)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    raise SystemExit("usage: python -m experiments.lib.bench.overlap '<json settings>'")
  settings = json.loads(sys.argv[1])
  pinned = pin_xla_threads() if settings.get("pin_xla") else None
  out = main_settings(settings)
  out.update(xla_cpus=sorted(pinned) if pinned else None, xla_thread_cpus=xla_thread_cpus())
  print(json.dumps(out), flush=True)
