"""Decode throughput under a device-memory cap: the paper's "under a memory limit, batch 3 -> 36 and up to 4.6x
throughput" (A6000, 48 GB, 32k), for each method and context.

Sizing. The memory plan (`specache_jax.memory_plan.plan_memory`, the offloaded runtime's own) gives a batch's
device bytes from shapes alone: the weights, the method's device state (SpeCache offloaded: everything but the
16-bit cache, which the host store holds) and one prefill chunk's activations (`config.prefill_rows` sequences at
a time, for every method: the capture below prefills one at a time). A method's max batch is the largest batch
whose bytes fit `config.cap_gib` (`max_batch`: batch + 1 does not fit); a batch over the cap is refused before
anything is built (`Sizing.check`, `CapError`). On a CPU the "device" is host RAM: nothing limits the process to
the cap, which is the plan's budget, enforced by that refusal.

Timing. Decode throughput (greedy, batch / seconds per step) at the max batch and at `config.fractions` of it.
The jitted methods decode with one jitted step per token (`throughput.decode_step_jit`); offloaded ones
(`offload=True`) through the offloaded runtime with its real host store (`RuntimeDriver`). Every row of a batch
is a copy of ONE real prefilled prompt per context: one prefill (`states.capture`) feeds every method and batch
(`states.build_cache(repeat=B)`, `OffloadRuntime.install_prompt(repeat=B)`). A step's time depends on the
shapes, not on the rows' values — except exact_on_miss's refetches, which follow the prompt's tokens.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import methods as exp_methods
from experiments.lib import models as exp_models
from experiments.lib.bench import states, timing
from experiments.lib.bench.common import RuntimeDriver, error_reason, random_prompts
from experiments.lib.bench.throughput import decode_step_jit, unstack_params_jit
from specache_jax.arrays import DTYPES, tree_nbytes
from specache_jax.memory_plan import MemoryPlan, MemoryPlanError, plan_memory
from specache_jax.model.init import init_params
from specache_jax.model_config import ModelConfig

CAP_NOTE = ("On a CPU the \"device\" is host RAM: nothing limits the process to the cap. The cap is the memory "
            "plan's budget (weights + the method's device state + one prefill chunk's activations, from shapes), "
            "enforced by refusing a batch whose planned bytes exceed it; the offloaded methods' host store (the "
            "16-bit cache) is real and lives outside the cap.")
CAP_NOTE_DEVICE = ("The cap is the memory plan's budget (weights + the method's device state + one prefill chunk's "
                   "activations, from shapes), enforced by refusing a batch whose planned bytes exceed it; the "
                   "process itself may use more of the device (XLA's own allocations are not capped here). The "
                   "offloaded methods' host store (the 16-bit cache) is real and lives in host RAM.")
CAP_NOTE_PLAN = "Plan only: the max batches from shapes; nothing was loaded or run."


def cap_note(plan_only: bool) -> str:
  if plan_only:
    return CAP_NOTE_PLAN
  return CAP_NOTE if jax.default_backend() == "cpu" else CAP_NOTE_DEVICE


class CapError(MemoryPlanError):
  """A batch whose planned device bytes exceed the cap (the numbers in the message)."""


def gib(n: float) -> str:
  return f"{n / 2**30:.3f} GiB"


class Sizing:
  """One method at one context under a cap: the plan of any batch, the cap's check and its largest batch."""

  def __init__(self, model_cfg, params, method, slots: int, prompt_len: int, dtype, cap_bytes: int,
               prefill_rows: int = 1, label: str = ""):
    if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes <= 0:
      raise ValueError(f"cap_bytes={cap_bytes!r} must be a positive int")
    if isinstance(prefill_rows, bool) or not isinstance(prefill_rows, int) or prefill_rows < 1:
      raise ValueError(f"prefill_rows={prefill_rows!r} must be an int >= 1")
    self.model_cfg, self.params, self.method, self.dtype = model_cfg, params, method, jnp.dtype(dtype)
    self.slots, self.prompt_len, self.cap, self.prefill_rows = slots, prompt_len, cap_bytes, prefill_rows
    self.label = label or method.name
    self.weights = tree_nbytes(params)

  def plan(self, batch: int) -> MemoryPlan:
    return plan_memory(self.model_cfg, self.method, self.params, batch, self.slots, self.dtype, self.prompt_len,
                       device_available=self.cap, prefill_rows=min(self.prefill_rows, batch))

  def parts(self, batch: int) -> dict:
    """The plan's device bytes of `batch` and their parts (weights, cache state, activations), host bytes."""
    p = self.plan(batch)
    return {"device_bytes": p.device_bytes, "weights_bytes": self.weights, "activation_bytes": p.activation_bytes,
            "cache_bytes": p.device_bytes - self.weights - p.activation_bytes, "host_bytes": p.host_bytes}

  def fits(self, batch: int) -> bool:
    return self.plan(batch).device_bytes <= self.cap

  def check(self, batch: int) -> MemoryPlan:
    """The plan of `batch`, or CapError when its device bytes exceed the cap."""
    p = self.plan(batch)
    if p.device_bytes > self.cap:
      cache = p.device_bytes - self.weights - p.activation_bytes
      raise CapError(f"batch={batch} of {self.label} ({self.slots} slots) needs {gib(p.device_bytes)} of device "
                     f"memory (weights {gib(self.weights)} + cache {gib(cache)} + activations "
                     f"{gib(p.activation_bytes)}), over the cap of {gib(self.cap)} (cap_bytes={self.cap}); the "
                     f"largest batch that fits is {max_batch(self.fits)}")
    return p


def max_batch(fits: Callable[[int], bool], limit: int = 1 << 20) -> int:
  """The largest batch in [1, limit] with fits(batch) (0 when even 1 does not fit), for a `fits` that is
  monotone (true up to some batch, false above): doubling, then bisection."""
  if not fits(1):
    return 0
  lo = 1
  while lo * 2 <= limit and fits(lo * 2):
    lo *= 2
  hi = min(lo * 2, limit + 1)                                   # fits(lo), not fits(hi) (or hi past the limit)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def batches_to_measure(top: int, fractions, limit: int = 0) -> list[int]:
  """The max batch and its `fractions` (each at least 1), largest first; limit > 0 drops batches above it."""
  if top < 1:
    return []
  out = sorted({max(1, int(top * float(f))) for f in fractions} | {top}, reverse=True)
  return [b for b in out if not limit or b <= limit]


def model_shapes(name: str, dtype: str):
  """(model config, params as ShapeDtypeStructs) of a `random:<shape>` model, nothing allocated: what a plan
  needs (the GPU config's plan on a machine that cannot hold its weights)."""
  shape = name.split(":", 1)[1] if name.startswith("random:") else ""
  if shape not in exp_models.SHAPES:
    raise ValueError(f"model={name!r}: a plan without loading needs random:<shape>, shape one of "
                     f"{sorted(exp_models.SHAPES)}")
  cfg = ModelConfig(**exp_models.SHAPES[shape], name=name)
  return cfg, jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), DTYPES[dtype or "float32"]))


def cell_shape(config, context: int) -> tuple[int, int]:
  """(prompt length, cache slots) of a context: the prompt leaves `margin` slots, the slots hold every step."""
  prompt_len = int(context) - int(config.margin)
  if prompt_len < 1:
    raise ValueError(f"context={context} must exceed margin={config.margin}")
  return prompt_len, states.cell_slots(prompt_len, config.warmup + config.rounds * config.steps + 1)


def plan_context(config, model_cfg, params, dtype, context: int, labels: list[str]) -> dict:
  """Every method's max batch at one context and the plan's bytes there (and one batch above it)."""
  prompt_len, slots = cell_shape(config, context)
  cap = int(config.cap_gib * 2**30)
  out = {}
  for label in labels:
    try:
      method = exp_methods.build(config, label, model_cfg, slots, dtype)
      sz = Sizing(model_cfg, params, method, slots, prompt_len, dtype, cap, int(config.prefill_rows), label)
      top = max_batch(sz.fits, int(config.batch_search_limit))
      out[label] = {"method": exp_methods.describe(method), "max_batch": top,
                    "at_max": sz.parts(top) if top else None, "above_max": sz.parts(top + 1)}
    except (ValueError, TypeError) as e:                       # e.g. a matched budget the context cannot hold
      out[label] = {"skipped": error_reason(e)}
  return out


class Decoder:
  """Greedy decoding of one (method, batch) from one captured prompt copied to every row."""

  def __init__(self, model, method, captured, first_1, tokens_1T, batch: int, slots: int, prompt_len: int):
    cfg, params = model.config, model.params
    first = jnp.repeat(first_1, batch)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    tokens = np.repeat(np.asarray(tokens_1T), batch, axis=0)
    t0 = time.perf_counter()
    if method.offload:
      self.drv = RuntimeDriver(model, method, batch, slots, prompt_len)
      self.drv.rt.install_prompt(captured.k, captured.v, lengths, tokens, repeat=batch, colsum_LBKT=captured.colsum)
      self.carry, self.step, self.sync = self.drv.start(first, lengths), self.drv.step, self.drv.sync
      self.state_bytes = lambda: self.drv.rt.device_bytes()
      self.host_bytes = lambda: int(self.drv.rt.store.nbytes)
    else:
      self.drv = None
      layer_params = unstack_params_jit(params, cfg.n_layers)
      cache = states.build_cache(captured, lengths, jnp.asarray(tokens), cfg=cfg, method=method, max_len=slots,
                                 repeat=batch)
      self.carry = states.first_decode_input(params, first, cache, cfg=cfg, method=method)
      self.step = lambda c: decode_step_jit(layer_params, c[0], c[1], cfg=cfg, method=method)
      self.sync = None
      self.state_bytes = lambda: method.device_bytes(self.carry[1].layers)
      self.host_bytes = lambda: 0
    timing.block(self.carry if self.sync is None else self.sync(self.carry))
    self.setup_s = time.perf_counter() - t0

  def close(self) -> None:
    """Stop the host store's worker and drop every reference to the state, the store and the steps (the
    closures refer back to this object: left to the cycle collector, a cell's store outlives the cell)."""
    if self.drv is not None:
      self.drv.rt.store.close()
    self.drv = self.carry = self.step = self.sync = self.state_bytes = self.host_bytes = None

  def measure(self, warmup: int, steps: int, rounds: int) -> dict:
    """`rounds` chains of `steps` back-to-back steps after `warmup` (the first compiles): median s per step."""
    samples = []
    for i in range(rounds):
      sec, self.carry = timing.time_chain(self.step, self.carry, warmup if i == 0 else 0, steps, sync=self.sync)
      samples.append(sec)
    return {"step_s": statistics.median(samples), "rounds_step_s": samples, "setup_s": self.setup_s,
            "state_bytes_measured": int(self.state_bytes()), "host_bytes_measured": self.host_bytes()}


def measure_context(config, model, context: int, plans: dict, deadline: float, log) -> dict:
  """One prefill at this context, then every method's max batch, then every method's next batch below, and so
  on (the max batches first, should the time run out)."""
  cfg, dtype = model.config, model.params["embed"].dtype
  prompt_len, slots = cell_shape(config, context)
  if time.perf_counter() > deadline:                 # no time left for any cell: the prefill is not run either
    return {"skipped": "out of time (config.max_seconds) before the prefill", "methods": {}}
  tokens, lengths = random_prompts(config.seed + int(context), 1, prompt_len, cfg.vocab_size)
  t0 = time.perf_counter()
  first, captured = states.capture(model.params, cfg, tokens, lengths)
  timing.block(captured)
  out = {"prefill_s": time.perf_counter() - t0, "methods": {}}
  log(f"S={context}: prefilled one prompt of {prompt_len} tokens in {out['prefill_s']:.1f} s")
  cap = int(config.cap_gib * 2**30)
  sizings = {}
  for label, plan in plans.items():
    if "skipped" not in plan:
      method = exp_methods.build(config, label, cfg, slots, dtype)
      sizings[label] = Sizing(cfg, model.params, method, slots, prompt_len, dtype, cap, int(config.prefill_rows),
                              label)
      out["methods"][label] = [{"batch": b, "is_max": b == plan["max_batch"]} for b in batches_to_measure(
          plan["max_batch"], config.fractions, int(config.max_measured_batch))]
  depth = max((len(rows) for rows in out["methods"].values()), default=0)
  for i in range(depth):
    for label, rows in out["methods"].items():
      if i < len(rows):
        measure_cell(model, sizings[label], captured, first, tokens, rows[i], config, deadline)
        rec = rows[i]
        log(f"S={context} {label} B={rec['batch']}: " + (f"skipped: {rec['skipped']}" if "skipped" in rec else
            f"{rec['step_s'] * 1e3:.1f} ms/step, {rec['tokens_per_s']:.1f} tok/s"))
  return out


def measure_cell(model, sz: Sizing, captured, first, tokens, rec: dict, config, deadline: float) -> None:
  """Decode rec["batch"] rows of the method (refused first when over the cap) into rec; a cell that cannot run
  (host memory, out of time) gets rec["skipped"] instead."""
  if time.perf_counter() > deadline:
    rec["skipped"] = "out of time (config.max_seconds)"
    return
  dec = None
  try:
    rec["planned_device_bytes"] = sz.check(rec["batch"]).device_bytes        # refuses a batch over the cap
    dec = Decoder(model, sz.method, captured, first, tokens, rec["batch"], sz.slots, sz.prompt_len)
    rec.update(dec.measure(config.warmup, config.steps, config.rounds))
    rec["tokens_per_s"] = rec["batch"] / rec["step_s"]
    if sz.method.offload and dec.drv.seen_rows:
      rec["speculation_miss_rate"] = dec.drv.miss_rows / dec.drv.seen_rows
  except Exception as e:  # recorded, not fatal
    rec["skipped"] = error_reason(e)
  finally:
    if dec is not None:
      dec.close()
    del dec
    gc.collect()


def headline(contexts: list[dict], reference: str) -> None:
  """Per context and method: tokens/s at the max batch and its ratio to the reference's at ITS max batch."""
  for ctx in contexts:
    measured = ctx.get("measured", {}).get("methods", {})
    at_max = {label: next((r for r in rows if r["is_max"] and "tokens_per_s" in r), None)
              for label, rows in measured.items()}
    ref = at_max.get(reference)
    for label, plan in ctx["plans"].items():
      rec = at_max.get(label)
      plan["tokens_per_s_at_max"] = rec["tokens_per_s"] if rec else None
      plan["tokens_per_s_ratio"] = timing.ratio(rec and rec["tokens_per_s"], ref and ref["tokens_per_s"])
      plan["max_batch_ratio"] = timing.ratio(plan.get("max_batch"), ctx["plans"].get(reference, {}).get("max_batch"))


def run(config, model=None, log: Callable[[str], None] = print) -> dict:
  """The plan (every context and method) and, unless `config.plan_only`, the measurement -> a JSON-ready dict.
  model: the loaded model (None with plan_only: shapes from `model_shapes`)."""
  t_start = time.perf_counter()
  deadline = t_start + float(config.max_seconds)
  labels = exp_methods.labels(config)
  if model is None:
    if not config.plan_only:
      raise ValueError("run needs the model unless config.plan_only")
    model_cfg, params = model_shapes(config.model, config.dtype)
    source = f"shapes of {config.model} (nothing loaded: plan only)"
  else:
    model_cfg, params, source = model.config, model.params, model.source
  dtype = params["embed"].dtype
  meta = {"experiment": "capped_throughput", "model": source, "model_config": model_cfg.name, "dtype": str(dtype),
          "cap_gib": float(config.cap_gib), "cap_bytes": int(config.cap_gib * 2**30),
          "prefill_rows": int(config.prefill_rows), "plan_only": bool(config.plan_only),
          "machine_start": timing.machine_info(), "warmup": config.warmup, "steps": config.steps,
          "rounds": config.rounds, "reference": config.reference, "fractions": list(config.fractions),
          "cap_note": cap_note(bool(config.plan_only)), "note": str(config.get("note", "")),
          "methods": {label: exp_methods.spec_of(config, label) for label in labels}}
  contexts = []
  for i, context in enumerate(config.contexts):
    ctx = {"context": int(context), "plans": plan_context(config, model_cfg, params, dtype, int(context), labels)}
    contexts.append(ctx)
    log(f"S={context}: max batch under {config.cap_gib} GiB: "
        + ", ".join(f"{k} {v.get('max_batch', '-')}" for k, v in ctx["plans"].items()))
    if not config.plan_only:              # each context gets an equal share of the time left
      now = time.perf_counter()
      share = now + (deadline - now) / (len(config.contexts) - i)
      ctx["measured"] = measure_context(config, model, int(context), ctx["plans"], share, log)
  headline(contexts, config.reference)
  meta["machine_end"] = timing.machine_info()
  meta["seconds"] = time.perf_counter() - t_start
  return {"meta": meta, "contexts": contexts}
