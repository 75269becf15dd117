"""A decode step's and a prefill's floors: the bytes a step must read and the FLOPs it must do (from shapes), and
the machine's read bandwidth measured while a benchmark cell runs (`lib/bench/machine.py` measures both limits)."""
from __future__ import annotations

import jax

from experiments.lib.bench import machine, timing


def weight_bytes_per_step(cfg, params) -> int:
  """Weights a decode step reads: all of them, except an untied embedding table (one row per token)."""
  total = int(sum(x.nbytes for x in jax.tree.leaves(params)))
  return total if cfg.tie_embeddings else total - int(params["embed"].nbytes)


def peer_cache_bytes(spec: dict, cfg, context: int, batch: int, itemsize: int) -> int:
  """The peer's cache at `context` tokens: fp K/V (dynamic), or quanto's packed codes + a scale and a shift per
  q_group_size elements (the ≤ residual_length fp tokens not counted)."""
  elems = 2 * cfg.n_layers * batch * cfg.n_kv_heads * context * cfg.head_dim
  if spec["cache"] == "dynamic":
    return elems * itemsize
  return elems * spec.get("nbits", 4) // 8 + 2 * elems // spec.get("q_group_size", 64) * itemsize


def weight_macs_per_token(cfg) -> int:
  """Multiply-adds of one token's projections and MLP over all layers (the LM head apart)."""
  d, h = cfg.dim, cfg.head_dim
  return cfg.n_layers * (d * (cfg.n_heads + 2 * cfg.n_kv_heads) * h + cfg.n_heads * h * d + 3 * d * cfg.ffn_dim)


def prefill_flops(cfg, batch: int, prompt_len: int) -> float:
  """Matmul FLOPs of the projections and MLP for every prompt token, causal attention (QKᵀ and PV over the lower
  triangle), and the LM head at the last position."""
  d, h = cfg.dim, cfg.head_dim
  per_token = weight_macs_per_token(cfg)
  attn = 2 * cfg.n_layers * cfg.n_heads * h * prompt_len * (prompt_len + 1)
  return float(batch * (2 * per_token * prompt_len + attn + 2 * d * cfg.vocab_size))


def decode_flops(cfg, batch: int, context: int, width: int = 1) -> float:
  """FLOPs of one decode step of `batch` sequences with `width` query rows each (SpeCache: 2, the real and the
  speculative token): every weight product (the LM head included) for every row, and attention over `context`
  positions counted as dense fp math (QKᵀ and PV), whatever the cache stores — a low-bit method does the same
  products on dequantized values (table lookups can do fewer; this is the floor of the straightforward way)."""
  d, rows = cfg.dim, batch * width
  attn = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
  return float(rows * (2 * weight_macs_per_token(cfg) + attn + 2 * d * cfg.vocab_size))


def floors(rec: dict, bytes_per_step: int, flops: float, limits: dict, step_flops: float = 0.0,
            read_Bps: float | None = None) -> None:
  """A step's floors: bytes at the read bandwidth (`x_floor`, issue 10's yardstick) and, where `step_flops` is
  given, its FLOPs at the GEMM rate; the roofline floor is the larger (`x_roofline`). read_Bps: the bandwidth
  measured within the step's own cell (default: the run's, measured at its start)."""
  bw, fl = read_Bps or limits["read_bandwidth"]["best_Bps"], limits["matmul"]["best_flops"]
  rec["bytes_per_step"] = int(bytes_per_step)
  rec["floor_step_s"] = bytes_per_step / bw
  rec["x_floor"] = timing.ratio(rec.get("step_s"), rec["floor_step_s"])
  if step_flops:
    rec["step_flops"] = step_flops
    rec["compute_floor_step_s"] = step_flops / fl
    rec["roofline_step_s"] = max(rec["floor_step_s"], rec["compute_floor_step_s"])
    rec["x_roofline"] = timing.ratio(rec.get("step_s"), rec["roofline_step_s"])
  rec["prefill_flops"] = flops
  rec["prefill_floor_s"] = flops / fl
  rec["prefill_x_floor"] = timing.ratio(rec.get("prefill_s"), rec["prefill_floor_s"])


def cell_bandwidth(config, limits: dict) -> float:
  """The machine's read bandwidth now (`machine.read_bandwidth`, as at the run's start: the same array size, threads
  and frameworks, best of 3): measured in every decode round of a cell, between the methods, so that a cell's
  × floor divides by what the shared machine read while that cell ran (it moves by ±25% within an hour here)."""
  bw = machine.read_bandwidth(int(config.machine.bandwidth_bytes), limits["jax_cpu_threads"], 3,
                              config.hf_device or None)
  return bw["best_Bps"]
