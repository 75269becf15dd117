"""Prefill on this CPU: blockwise causal attention vs the dense reference, alone and inside SmolLM2-135M (fp32).

  python -m experiments.prefill_bench --config=configs/prefill_bench.py     # results/prefill_cpu.{json,md}
  python -m experiments.prefill_bench --config=configs/prefill_bench.py:smoke --config.out=/tmp/p.json

Parts (each timing interleaves its variants round by round and records wall and process-CPU seconds and the
load average around it; the machine is shared, so CPU seconds say more than wall seconds when it is busy):
  check      blockwise == dense reference (out and colsum) on a ragged random batch at SmolLM2's head shapes
  blocks     attention alone at config.block_context for each of config.block_sizes (block_q x block_k), +
             compile time
  structure  the shipped loop structure vs static per-query-block strips (compile and run time)
  attention  attention alone, old (dense) vs new (blockwise), at each context
  model      whole-model prefill (logits of the last row only), old vs new, at each context;
             the old model runs config.old_model_rounds times at the contexts in config.old_model_contexts
  layer      one layer's parts at the largest context: q/k/v + RoPE, attention, o_proj, MLP
  gemm       the machine's fp32 matmul rate through XLA, for the GFLOP/s figures
  memory     compile only: the whole-model prefill's temporary buffers at config.memory_contexts, old vs new
"""
import contextlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.bench.prefill_report import markdown
from experiments.lib.bench.timing import load_average, machine_info
from experiments.lib.store import atomic_write_json, atomic_write_text
import specache_jax as sj
from specache_jax.caches import attention as A
from specache_jax.errors import ConfigError
from specache_jax.model import decoder
from specache_jax.model.layers import rms_norm, swiglu_mlp

PARTS = ("check", "gemm", "blocks", "structure", "attention", "model", "layer", "memory")


# ---------------------------------------------------------------- timing

def _timed(fn, *args):
  """(wall s, process CPU s, result) of one blocked call."""
  w, c = time.perf_counter(), time.process_time()
  result = jax.block_until_ready(fn(*args))
  return time.perf_counter() - w, time.process_time() - c, result


def _compile(fn, *args):
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def _interleaved(variants: dict, args: tuple, rounds: dict | int, flops: float, warmup: bool,
                 last: dict | None = None) -> dict:
  """variants: name -> compiled fn. One warm-up call each (if `warmup`), then rounds in turn. Medians and
  GFLOP/s. `last`, if given, receives each variant's last result."""
  rounds = rounds if isinstance(rounds, dict) else {name: rounds for name in variants}
  if warmup:
    for fn in variants.values():
      jax.block_until_ready(fn(*args))
  samples = {name: [] for name in variants}
  load_before = load_average()
  for r in range(max(rounds.values())):
    for name, fn in variants.items():
      if r < rounds[name]:
        *sample, result = _timed(fn, *args)
        samples[name].append(sample)
        if last is not None:
          last[name] = result
        print(f"  {name}: wall {samples[name][-1][0]:.3f} s, CPU {samples[name][-1][1]:.3f} s, "
              f"load {load_average()}", flush=True)
  out = {}
  for name, xs in samples.items():
    wall, cpu = float(np.median([x[0] for x in xs])), float(np.median([x[1] for x in xs]))
    out[name] = {"wall_s": wall, "cpu_s": cpu, "wall_samples_s": [round(x[0], 4) for x in xs],
                 "cpu_samples_s": [round(x[1], 4) for x in xs], "gflops_per_s": flops / wall / 1e9,
                 "gflops_per_cpu_s": flops / cpu / 1e9}
  out["load_average_before_after"] = [load_before, load_average()]
  return out


@contextlib.contextmanager
def _prefill_attention(impl):
  """Trace the decoder with another prefill attention (the decoder looks it up when traced)."""
  saved = A.prefill_attention
  A.prefill_attention = impl
  try:
    yield
  finally:
    A.prefill_attention = saved


# ---------------------------------------------------------------- shapes and FLOPs

def _attention_inputs(cfg, t: int, batch: int = 1, seed: int = 0):
  rs = np.random.RandomState(seed)
  q = jnp.asarray(rs.randn(batch, t, cfg.n_heads, cfg.head_dim), jnp.float32)
  k = jnp.asarray(rs.randn(batch, t, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
  v = jnp.asarray(rs.randn(batch, t, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
  return q, k, v


def attention_flops(cfg, t: int) -> float:
  """Causal attention of one layer: q.k and p.v over the t(t+1)/2 visible pairs, per query head."""
  return 2 * 2 * t * (t + 1) / 2 * cfg.n_heads * cfg.head_dim


def layer_weight_params(cfg) -> int:
  d, h = cfg.dim, cfg.head_dim
  return d * cfg.n_heads * h * 2 + d * cfg.n_kv_heads * h * 2 + 3 * d * cfg.ffn_dim


def model_flops(cfg, t: int) -> dict:
  """Prefill FLOPs with the LM head on the last row only (what the first token needs)."""
  weights = 2 * layer_weight_params(cfg) * cfg.n_layers * t
  attention = attention_flops(cfg, t) * cfg.n_layers
  head = 2 * cfg.dim * cfg.vocab_size
  return {"weights": weights, "attention": attention, "lm_head": head, "total": weights + attention + head}


# ---------------------------------------------------------------- parts

def part_check(cfg) -> dict:
  """Blockwise vs dense on a ragged batch (T not a multiple of the block, a length-1 row), both colsum modes."""
  t, lengths = 1000, jnp.asarray([1000, 1, 613])
  q, k, v = _attention_inputs(cfg, t, batch=3, seed=1)
  out = {}
  for want in (False, True):
    new = jax.jit(lambda q, k, v, n, w=want: A.prefill_attention(q, k, v, n, cfg.head_dim ** -0.5, w))
    o, c = new(q, k, v, lengths)
    ro, rc = A.prefill_attention_reference(q, k, v, lengths, cfg.head_dim ** -0.5, want)
    out[f"max_abs_err_out_colsum={want}"] = float(jnp.max(jnp.abs(o - ro)))
    if want:
      out["max_abs_err_colsum"] = float(jnp.max(jnp.abs(c - rc)))
  out["ok"] = all(v <= 1e-4 for k_, v in out.items() if k_.startswith("max"))
  if not out["ok"]:
    raise AssertionError(f"blockwise prefill attention differs from the reference: {out}")
  return out


def part_blocks(cfg, config) -> dict:
  t = config.block_context
  q, k, v = _attention_inputs(cfg, t)
  lengths = jnp.asarray([t])
  variants, compile_s = {}, {}
  for size in config.block_sizes.split(","):
    bq, bk = (int(x) for x in size.split("x"))
    fn = lambda q, k, v, n, bq=bq, bk=bk: A.prefill_attention(q, k, v, n, cfg.head_dim ** -0.5, False,
                                                               A.PrefillBlocks(bq, bk))[0]
    variants[size], compile_s[size] = _compile(fn, q, k, v, lengths)
  res = _interleaved(variants, (q, k, v, lengths), config.rounds, attention_flops(cfg, t),
                     config.warmup)
  for size in variants:
    res[size]["compile_s"] = compile_s[size]
  return {"context": t, "results": res}


def _static_strips(q_BTNH, k_BTKH, v_BTKH, lengths_B, sm_scale, block_q):
  """For comparison only: per query block, a dense masked softmax over its static key prefix (a Python loop
  over query blocks, no online softmax); skips the upper triangle but forms [block_q, prefix] strips."""
  b, t, n, h = q_BTNH.shape
  n_kv = k_BTKH.shape[2]
  outs = []
  for start in range(0, t, block_q):
    stop = min(start + block_q, t)
    q_pos = jnp.arange(start, stop)
    key_pos = jnp.arange(stop)
    mask = (q_pos[:, None] >= key_pos[None, :])[None] & (key_pos[None, None, :] < lengths_B[:, None, None])
    keys = jnp.swapaxes(k_BTKH[:, :stop], 1, 2)
    values = jnp.swapaxes(v_BTKH[:, :stop], 1, 2)
    o, _ = A.segmented_attention(q_BTNH[:, start:stop], [(keys, values, mask[:, None])], sm_scale, n_kv)
    outs.append(o)
  return jnp.concatenate(outs, axis=1)


def part_structure(cfg, config) -> dict:
  out = {}
  for t in (4096, 8192):
    q, k, v = _attention_inputs(cfg, t)
    lengths = jnp.asarray([t])
    scale = cfg.head_dim ** -0.5
    fns = {"scan+fori (shipped, 256x256)": lambda q, k, v, n: A.prefill_attention(q, k, v, n, scale, False)[0],
           "static strips 512": lambda q, k, v, n: _static_strips(q, k, v, n, scale, 512),
           "static strips 1024": lambda q, k, v, n: _static_strips(q, k, v, n, scale, 1024)}
    variants, compile_s = {}, {}
    for name, fn in fns.items():
      variants[name], compile_s[name] = _compile(fn, q, k, v, lengths)
    res = _interleaved(variants, (q, k, v, lengths), config.rounds, attention_flops(cfg, t),
                       config.warmup)
    for name in variants:
      res[name]["compile_s"] = compile_s[name]
    out[str(t)] = res
  return out


def part_attention(cfg, config) -> dict:
  out = {}
  scale = cfg.head_dim ** -0.5
  for t in config.contexts:
    q, k, v = _attention_inputs(cfg, t)
    lengths = jnp.asarray([t])
    variants = {}
    variants["old"], _ = _compile(lambda q, k, v, n: A.prefill_attention_reference(q, k, v, n, scale, False)[0],
                                  q, k, v, lengths)
    variants["new"], _ = _compile(lambda q, k, v, n: A.prefill_attention(q, k, v, n, scale, False)[0],
                                  q, k, v, lengths)
    variants["new+colsum"], _ = _compile(lambda q, k, v, n: A.prefill_attention(q, k, v, n, scale, True),
                                         q, k, v, lengths)
    out[str(t)] = _interleaved(variants, (q, k, v, lengths), config.rounds, attention_flops(cfg, t),
                               config.warmup)
  return out


def _model_prefill(impl):
  def run(params, tokens_BT, cfg):
    with _prefill_attention(impl):
      logits, _, _ = decoder.forward(params, cfg, tokens_BT, None, None, "prefill",
                                     logits_at=jnp.full((tokens_BT.shape[0],), tokens_BT.shape[1] - 1))
    return logits
  return run


def part_model(model, config) -> dict:
  cfg, params = model.config, model.params
  out = {}
  for t in config.contexts:
    tokens = jnp.asarray(np.random.RandomState(t).randint(0, cfg.vocab_size, size=(1, t)), jnp.int32)
    impls = {"new": A.prefill_attention}
    if t in config.old_model_contexts:
      impls["old"] = A.prefill_attention_reference
    variants, compile_s = {}, {}
    for name, impl in impls.items():
      fn = _model_prefill(impl)
      t0 = time.perf_counter()
      variants[name] = jax.jit(fn, static_argnums=2).lower(params, tokens, cfg).compile()
      compile_s[name] = time.perf_counter() - t0
    rounds = {"new": config.rounds, "old": config.old_model_rounds}
    fl = model_flops(cfg, t)
    last = {}
    res = _interleaved({n: (lambda p, x, f=f: f(p, x)) for n, f in variants.items()}, (params, tokens),
                       {n: rounds[n] for n in variants}, fl["total"], config.warmup, last)
    if "old" in variants:     # the two agree on the next token's logits
      res["max_abs_logit_diff_new_vs_old"] = float(np.max(np.abs(np.asarray(last["new"]) - last["old"])))
    for name in variants:
      res[name]["compile_s"] = compile_s[name]
    out[str(t)] = {"flops": fl, "results": res}
  return out


def part_memory(model, config) -> dict:
  """Compile only: the whole-model prefill's temporary buffers (XLA's memory analysis), old vs new."""
  cfg, params = model.config, model.params
  out = {}
  for t in config.memory_contexts:
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
    out[str(t)] = {}
    for name, impl in (("new", A.prefill_attention), ("old", A.prefill_attention_reference)):
      compiled = jax.jit(_model_prefill(impl), static_argnums=2).lower(params, tokens, cfg).compile()
      out[str(t)][name] = {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}
  return out


def part_layer(model, config) -> dict:
  cfg, params = model.config, model.params
  t = max(config.contexts)
  lp = jax.tree.map(lambda x: x[0], params["layers"])
  x = jax.random.normal(jax.random.key(0), (1, t, cfg.dim), jnp.float32) * 0.1
  lengths = jnp.asarray([t])
  rope = decoder.rope_for(cfg, "prefill", lengths, t)
  q, k, v = jax.jit(lambda x: decoder.attention_inputs(cfg, lp, x, rope))(x)
  attn = jnp.zeros((1, t, cfg.n_heads, cfg.head_dim), jnp.float32)
  d, h = cfg.dim, cfg.head_dim
  parts = {
      "qkv+rope": (lambda x: decoder.attention_inputs(cfg, lp, x, rope), (x,),
                   2 * t * d * (cfg.n_heads + 2 * cfg.n_kv_heads) * h),
      "attention": (lambda q, k, v: A.prefill_attention(q, k, v, lengths, h ** -0.5, False)[0], (q, k, v),
                    attention_flops(cfg, t)),
      "o_proj+residual": (lambda x, a: x + jnp.einsum("bte,ed->btd", a.reshape(1, t, -1), lp["wo"]), (x, attn),
                          2 * t * cfg.n_heads * h * d),
      "mlp_norm+mlp": (lambda x: swiglu_mlp(rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp), (x,),
                       2 * t * 3 * d * cfg.ffn_dim),
      "mlp_norm+mlp, rows in chunks of 2048 (lax.map)": (lambda x: decoder.in_row_chunks(
          lambda c: swiglu_mlp(rms_norm(c, lp["mlp_norm"], cfg.norm_eps), lp), x, chunk=2048), (x,),
          2 * t * 3 * d * cfg.ffn_dim),
      "whole layer": (lambda x: decoder.layer_forward(cfg, None, lp, x, lengths, None, "prefill", rope)[0], (x,),
                      2 * t * layer_weight_params(cfg) + attention_flops(cfg, t)),
  }
  out = {"context": t}
  for name, (fn, args, fl) in parts.items():
    compiled, _ = _compile(fn, *args)
    res = _interleaved({name: compiled}, args, config.rounds, fl, config.warmup)
    out[name] = dict(res[name], flops=fl, load_average_before_after=res["load_average_before_after"])
  return out


def part_gemm(config) -> dict:
  out = {}
  for m, k, n in ((8192, 576, 1536), (2048, 576, 1536), (2048, 1536, 576)):
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    compiled, _ = _compile(lambda a, b: a @ b, a, b)
    res = _interleaved({"gemm": compiled}, (a, b), max(config.rounds, 5), 2 * m * k * n,
                       config.warmup)
    out[f"{m}x{k}x{n}"] = res["gemm"]
  return out


# ---------------------------------------------------------------- run

def run(config, command: str) -> dict:
  """The parts of `config` (configs/prefill_bench.py) in PARTS order; after each, <config.out> (JSON) and its
  .md are rewritten. With config.append the parts merge into an existing report (per part and context)."""
  parts = [p for p in config.parts.split(",") if p]
  unknown = set(parts) - set(PARTS)
  if unknown:
    raise ConfigError(f"parts={config.parts!r}: unknown parts {sorted(unknown)}; choose from {PARTS}")
  report = {"commands": [], "machines": []}
  if config.append and os.path.exists(config.out):
    with open(config.out) as f:
      report = json.load(f)
  report["commands"].append(command)
  report["machines"].append(machine_info())
  model = sj.load_model(config.model)
  cfg = model.config
  report["n_layers"] = cfg.n_layers
  runners = {"check": lambda: part_check(cfg), "gemm": lambda: part_gemm(config),
             "blocks": lambda: part_blocks(cfg, config), "structure": lambda: part_structure(cfg, config),
             "attention": lambda: part_attention(cfg, config), "model": lambda: part_model(model, config),
             "layer": lambda: part_layer(model, config), "memory": lambda: part_memory(model, config)}
  for name in PARTS:
    if name in parts:
      t0 = time.perf_counter()
      result = runners[name]()
      if name in ("attention", "model", "structure") and isinstance(report.get(name), dict):
        report[name].update(result)       # per context
      else:
        report[name] = result
      print(f"{name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
      atomic_write_json(config.out, report)
      atomic_write_text(os.path.splitext(config.out)[0] + ".md", markdown(report) + "\n")
  print(markdown(report))
  return report
