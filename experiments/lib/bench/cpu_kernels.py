"""The XLA:CPU decoding kernels (`specache_jax.cpu_kernels`: skinny matmul, mixed low-bit attention, κ's top-k and
row gathers) vs XLA on this CPU:

  python -m experiments.cpu_kernel_bench --config=configs/cpu_kernel_bench.py   # results/cpu_kernels.{json,md}
  python -m experiments.cpu_kernel_bench --config=configs/cpu_kernel_bench.py:smoke --config.out=/tmp/ck

products  a decoding step's weight products alone (SmolLM2-135M shapes, random float32 weights: per layer
          q/k/v in one product, o, gate/up in one, down; 30 layers; the tied LM head), M rows, XLA's dot vs the
          kernel for every M (whatever `cpu_kernels.use_kernel` picks); GB/s and × the machine's read floor.
layers    SpeCache 1-bit's per-layer kernels alone, once per layer: the mixed attention vs its jnp reference and
          κ's top-k vs lax.top_k (random codes and scores of `config.contexts` slots, 2 rows per sequence).
steps     whole greedy decoding steps of the library (random weights and a random cache state of
          `config.contexts` tokens, as peer_bench's scaling curve) with every kernel (what the library picks), with the matmul kernel
          alone (low-bit attention, κ's top-k and row gathers by XLA; SpeCache and KIVI) and with none
          (SPECACHE_JAX_CPU_KERNELS=0 while tracing): the same steps, interleaved round by round.
Every variant's output is checked against XLA's before timing (products: ≤ 1e-4 relative; steps: the same
greedy tokens over the first step).
"""
from __future__ import annotations

import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import methods as exp_methods
from experiments.lib.bench import machine, models as bench_models, peer, states, throughput, timing
from experiments.lib.store import atomic_write_json, atomic_write_text
from pallas_kernels.mixed_decode_attention import mixed_decode_attention_reference as mixed_reference
from specache_jax import cpu_kernels as ck
from specache_jax.cpu_kernels import mixed_attention as cpu_attention
from specache_jax.cpu_kernels import select as cpu_select
from specache_jax.errors import ConfigError
from specache_jax.model import decoder as dec

SHAPE = "smollm2-135m"
# whole steps with: every kernel (what the library picks), the matmul kernel alone (attention, top-k, gathers by
# XLA), none
VARIANTS = ("kernel", "matmul", "xla")


def _expected(variant: str, method, batch: int, head_dim: int) -> tuple[bool, bool, bool]:
  """(skinny matmul, mixed attention, top-k or scatter + top-k) custom calls a step traced as `variant` must
  have."""
  rows = batch * method.speculation.width
  matmul = variant != "xla" and (ck.use_kernel(rows, False) or ck.use_kernel(rows, True))
  attention = variant == "kernel" and method.name in ("specache", "kivi") and cpu_attention.supports(
      method.bits, method.group_size, head_dim)
  return matmul, attention, variant == "kernel" and method.name == "specache"


def layer_kernels(cfg, context: int, batch: int, rounds: int) -> dict:
  """SpeCache 1-bit's per-layer kernels alone, called once per layer (random codes: g = 64, 64 κ rows excluded,
  the ring's and κ's 16-bit columns and the 2 new rows as the extra columns; the real and the speculative row):
  the mixed attention vs its float32 jnp reference, κ's top-k vs lax.top_k over the slots."""
  rng = np.random.default_rng(context + batch)
  b, t, n, kh, h, g, x = batch, 2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 64, 64
  s = -(-(context + 256) // g) * g
  e = 64 + x + t
  f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)     # noqa: E731
  codes = lambda: jnp.asarray(rng.integers(0, 256, (b, kh, s, h // 8), dtype=np.uint8))   # noqa: E731
  q_layers = f32(cfg.n_layers, b, t, n, h)               # one query per layer: identical calls would be merged
  args = (q_layers, codes(), jnp.abs(f32(b, kh, s // g, h)), f32(b, kh, s // g, h), codes(),
          jnp.abs(f32(b, kh, s, 1)), f32(b, kh, s, 1), jnp.full((b,), context, jnp.int32),
          jnp.asarray(rng.integers(0, context, (b, kh, x)), jnp.int32), f32(b, kh, e, h), f32(b, kh, e, h),
          jnp.ones((b, kh, t, e), bool))
  kw = dict(bits=1, group_size=g, sm_scale=h ** -0.5, prob_rows=1)
  scores = jnp.asarray(rng.random((cfg.n_layers, b * kh, s)) ** 8, jnp.float32)

  def attention(fn):
    return jax.jit(lambda a: [fn(a[0][i], *a[1:], **kw) for i in range(cfg.n_layers)])

  def top_k(fn):
    return jax.jit(lambda sc: [fn(sc[i]) for i in range(cfg.n_layers)])

  att = {"kernel": attention(cpu_attention.mixed_decode_attention), "xla": attention(mixed_reference)}
  sel = {"kernel": top_k(lambda v: cpu_select.top_k_indices(v, x)),
         "xla": top_k(lambda v: cpu_select.top_k_indices_reference(v, x))}
  got, want = att["kernel"](args)[0], att["xla"](args)[0]
  err = max(float(jnp.max(jnp.abs(a - w)) / jnp.max(jnp.abs(w))) for a, w in zip(got, want))
  same = bool(jnp.all(sel["kernel"](scores)[0] == sel["xla"](scores)[0]))
  if err > 1e-4 or not same:
    raise AssertionError(f"layer kernels disagree with XLA at S={context} B={batch}: attention rel err {err:.2e}, "
                         f"top-k equal {same}")
  samples = _rounds({**{f"attention_{k}": (lambda f=f: f(args)) for k, f in att.items()},
                     **{f"top_k_{k}": (lambda f=f: f(scores)) for k, f in sel.items()}}, rounds)
  out = {"S": context, "B": batch, "slots": s, "max_rel_err": err}
  out.update({k: 1e3 * statistics.median(v) for k, v in samples.items()})
  return out


def _rounds(fns: dict, rounds: int) -> dict:
  """name -> seconds per call of fns[name]() (blocked on its result), the names interleaved, order alternating."""
  samples = {name: [] for name in fns}
  for r in range(rounds):
    for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
      t0 = time.perf_counter()
      timing.block(fns[name]())
      samples[name].append(time.perf_counter() - t0)
  return samples


def products(params, cfg, rows: int, rounds: int, bandwidth: float) -> dict:
  layers = dec.unstack_layers(params["layers"], cfg.n_layers)
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cfg.dim)), jnp.float32)
  xf = jnp.asarray(np.random.default_rng(rows + 1).standard_normal((rows, cfg.ffn_dim)), jnp.float32)
  xa = jnp.asarray(np.random.default_rng(rows + 2).standard_normal((rows, cfg.n_heads * cfg.head_dim)),
                   jnp.float32)
  groups = []                                                   # (input, weights, transposed) per call
  for lp in layers:
    groups += [(x, (lp["wq"], lp["wk"], lp["wv"]), False), (xa, (lp["wo"],), False),
               (x, (lp["w_gate"], lp["w_up"]), False), (xf, (lp["w_down"],), False)]
  groups.append((x, (params["embed"],), True))

  def xla(groups):
    return [ck.skinny_matmul_reference(g[0], g[1], g[2]) for g in groups]

  def kernel(groups):
    return [ck.skinny_matmul(g[0], g[1], g[2]) for g in groups]

  static = [g[2] for g in groups]
  fns = {name: jax.jit(lambda arrays, f=f: f([(a, w, t) for (a, w), t in zip(arrays, static)]))
         for name, f in (("xla", xla), ("kernel", kernel))}
  arrays = [(g[0], g[1]) for g in groups]
  want, got = fns["xla"](arrays), fns["kernel"](arrays)
  err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
            for wa, ga in zip(want, got) for a, b in zip(wa, ga))
  if err > 1e-4:
    raise AssertionError(f"kernel differs from XLA's dot at M={rows}: {err:.2e} relative")
  samples = _rounds({name: (lambda f=f: f(arrays)) for name, f in fns.items()}, rounds)
  nbytes = sum(w.nbytes for g in groups for w in g[1])
  out = {"rows": rows, "weight_bytes": nbytes, "max_rel_err": err}
  for name, s in samples.items():
    sec = statistics.median(s)
    out[name] = {"ms": sec * 1e3, "GBps": nbytes / sec / 1e9, "x_floor": sec / (nbytes / bandwidth),
                 "samples_ms": [round(v * 1e3, 3) for v in s]}
  out["kernel_vs_xla"] = out["kernel"]["ms"] / out["xla"]["ms"]
  return out


def steps(model, config, context: int, batch: int, rounds: int, n_steps: int) -> dict:
  """Whole greedy steps of each of config.run_methods (labels of config.methods) with every kernel / the matmul
  kernel alone / none."""
  cfg, method_labels = model.config, exp_methods.labels(config)
  lp = dec.unstack_params(model.params, cfg.n_layers)
  prompt = context - 64
  slots = states.cell_slots(prompt, 1 + rounds * n_steps + 2)
  captured = peer.random_captured(cfg, batch, prompt, context, jnp.float32)
  first = jnp.asarray(np.random.RandomState(context).randint(0, cfg.vocab_size, batch), jnp.int32)
  lengths = jnp.full((batch,), prompt, jnp.int32)
  fns, carries, out = {}, {}, {}
  for label in method_labels:
    method = exp_methods.build(config, label, cfg, slots, jnp.float32)
    firsts = {}
    for variant in VARIANTS if method.name in ("specache", "kivi") else ("kernel", "xla"):
      os.environ[ck.ENV_SWITCH] = "0" if variant == "xla" else "1"
      ck._load.cache_clear()
      applies, select_applies = cpu_attention.applies, cpu_select.applies
      if variant == "matmul":                                    # the attention and select kernels off while tracing
        cpu_attention.applies = lambda *a: False
        cpu_select.applies = lambda: False
      try:
        cache = states.build_cache(captured, lengths, cfg=cfg, method=method, max_len=slots)
        carry = timing.block(states.first_decode_input(model.params, first, cache, cfg=cfg, method=method))
        # the library's greedy step, traced (and compiled) under the switch: a fresh function per setting, since
        # jax reuses a trace across jit objects of the same function (the switch is read while tracing)
        step = lambda *a, **k: throughput.decode_step_jit.__wrapped__(*a, **k)   # noqa: E731
        fn = functools.partial(jax.jit(step, static_argnames=("cfg", "method"), donate_argnums=(2,)), cfg=cfg,
                               method=method)
        text = fn.func.lower(lp, *carry, cfg=cfg, method=method).as_text()
        found = (ck.TARGET in text, ck.ATTENTION_TARGET in text,              # κ's top-k: alone or with its scatter
                 ck.TOP_K_TARGET in text or ck.SCATTER_TOP_K_TARGET in text)
        if found != _expected(variant, method, batch, cfg.head_dim):
          raise AssertionError(f"{label}: the step traced as {variant!r} does not have the kernels it should")
        carry = timing.block(fn(lp, *carry))
      finally:
        os.environ.pop(ck.ENV_SWITCH, None)
        ck._load.cache_clear()
        cpu_attention.applies, cpu_select.applies = applies, select_applies
      name = f"{label} {variant}"
      firsts[variant] = np.asarray(carry[0])
      carries[name] = carry
      fns[name] = lambda name=name, fn=fn: _chain(fn, lp, carries, name, n_steps)
    if any(not np.array_equal(firsts["kernel"], f) for f in firsts.values()):
      raise AssertionError(f"{label}: the first greedy step differs with and without the kernels")
  del captured
  samples = _rounds(fns, rounds)
  for label in method_labels:
    rec = {}
    for variant in VARIANTS:
      if f"{label} {variant}" not in samples:
        continue
      s = [v / n_steps for v in samples[f"{label} {variant}"]]
      rec[variant] = {"ms_per_step": statistics.median(s) * 1e3, "samples_ms": [round(v * 1e3, 2) for v in s]}
    rec["kernel_vs_xla"] = rec["kernel"]["ms_per_step"] / rec["xla"]["ms_per_step"]
    if "matmul" in rec:
      rec["kernel_vs_matmul"] = rec["kernel"]["ms_per_step"] / rec["matmul"]["ms_per_step"]
    out[label] = rec
  return out


def _chain(fn, lp, carries: dict, name: str, n: int):
  """n steps back to back from carries[name] (updated: the cache buffers are donated)."""
  for _ in range(n):
    carries[name] = fn(lp, *carries[name])
  return carries[name]


def _markdown(rep: dict) -> str:
  m = rep["meta"]
  lines = ["# The CPU decoding kernels vs XLA (specache_jax.cpu_kernels: skinny matmul, mixed low-bit "
           "attention, top-k and row gathers)", "",
           f"Command: `{m['command']}`", "",
           f"- machine: {m['machine']}; read bandwidth {m['bandwidth_GBps']:.1f} GB/s (best of "
           f"{', '.join(m['bandwidth_of'])}); load average at start {m['load_start']}, at end {m['load_end']}",
           f"- kernel status: {m['kernel_status']}; `dense` takes it for these rows (inclusive) by weight layout: "
           f"{m['use_kernel']} (dn: [D, N] weights; nd: the tied LM head [N, D])",
           f"- medians of {m['rounds']} interleaved rounds; SmolLM2-135M shapes, random float32 weights", "",
           "## A step's weight products alone (30 layers: q/k/v, o, gate/up, down; tied LM head)", "",
           "| rows M | weights | XLA ms (GB/s, × floor) | kernel ms (GB/s, × floor) | kernel ÷ XLA |", "|---|---|---|---|---|"]
  for p in rep["products"]:
    cell = lambda v: f"{v['ms']:.2f} ({v['GBps']:.1f}, {v['x_floor']:.2f}×)"
    lines.append(f"| {p['rows']} | {p['weight_bytes'] / 2**20:.0f} MiB | {cell(p['xla'])} | {cell(p['kernel'])} "
                 f"| {p['kernel_vs_xla']:.2f} |")
  lines += ["", "## SpeCache 1-bit's per-layer kernels alone (30 calls, one per layer; 2 rows per sequence)", "",
            "| S | B | slots | attention: kernel ms | XLA (jnp reference) ms | top-k: kernel ms | lax.top_k ms |",
            "|---|---|---|---|---|---|---|"]
  for c in rep.get("layers", []):
    lines.append(f"| {c['S']} | {c['B']} | {c['slots']} | {c['attention_kernel']:.2f} | {c['attention_xla']:.2f} | "
                 f"{c['top_k_kernel']:.2f} | {c['top_k_xla']:.2f} |")
  lines += ["", "## Whole decoding steps: every kernel / the matmul kernel alone (attention, top-k, gathers by XLA) "
            "/ none", "",
            "| S | B | method | rows per product | kernels ms/step | matmul kernel only | XLA ms/step | kernels ÷ XLA "
            "| kernels ÷ matmul only |", "|---|---|---|---|---|---|---|---|---|"]
  for c in rep["steps"]:
    for label, r in c["methods"].items():
      rows = c["B"] * (2 if label.startswith("specache") else 1)
      mm = f"{r['matmul']['ms_per_step']:.1f}" if "matmul" in r else "–"
      ratio = f"{r['kernel_vs_matmul']:.2f}" if "matmul" in r else "–"
      lines.append(f"| {c['S']} | {c['B']} | {label} | {rows} | {r['kernel']['ms_per_step']:.1f} | {mm} | "
                   f"{r['xla']['ms_per_step']:.1f} | {r['kernel_vs_xla']:.2f} | {ratio} |")
  return "\n".join(lines) + "\n"


def run(config, command: str) -> dict:
  """The products, layer kernels and whole steps of `config` (configs/cpu_kernel_bench.py); writes
  <config.out>.json and .md, returns the report."""
  if not ck.available():
    raise ConfigError(f"the CPU kernels are {ck.status()}")
  model = bench_models.load(f"random:{SHAPE}", "float32", 0)
  bw = machine.read_bandwidth(1 << 30, machine.cpu_threads(), torch_device=None)
  rep = {"meta": {"command": command, "machine": timing.machine_info(), "load_start": timing.load_average(),
                  "bandwidth_GBps": bw["best_Bps"] / 1e9, "bandwidth_of": bw["best_of"], "rounds": config.rounds,
                  "kernel_status": ck.status(), "use_kernel": ck.DENSE_ROWS},
         "products": [], "layers": [], "steps": []}
  for rows in config.rows:
    rep["products"].append(products(model.params, model.config, rows, config.rounds, bw["best_Bps"]))
    p = rep["products"][-1]
    print(f"products M={rows}: xla {p['xla']['ms']:.2f} ms, kernel {p['kernel']['ms']:.2f} ms")
  for batch in config.batches:
    for context in config.contexts:
      rep["layers"].append(layer_kernels(model.config, context, batch, config.rounds))
      c = rep["layers"][-1]
      print(f"layer kernels S={context} B={batch}: attention {c['attention_kernel']:.2f} ms (XLA "
            f"{c['attention_xla']:.2f}), top-k {c['top_k_kernel']:.2f} ms (XLA {c['top_k_xla']:.2f})")
      cell = {"S": context, "B": batch, "methods": steps(model, config, context, batch, config.rounds, config.steps)}
      rep["steps"].append(cell)
      print(f"steps S={context} B={batch}: " + ", ".join(
          f"{k} " + " / ".join(f"{v[x]['ms_per_step']:.1f}" for x in VARIANTS if x in v) + " ms" for k, v in
          cell["methods"].items()))
  rep["meta"]["load_end"] = timing.load_average()
  atomic_write_json(config.out + ".json", rep)
  atomic_write_text(config.out + ".md", _markdown(rep))
  return rep
