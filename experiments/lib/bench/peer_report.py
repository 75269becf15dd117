"""The peer benchmark's report: the markdown tables and the step-time-vs-context plot of `peer.run`'s result."""
from __future__ import annotations

def _f(x, fmt="{:.2f}", none="—") -> str:
  return none if x is None else fmt.format(x)


def _ms(seconds):
  return None if seconds is None else seconds * 1e3


def _size(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{int(n)} B"


def _cell_bw(c: dict) -> str:
  bw = c.get("read_bandwidth")
  if not bw:
    return "— (the run's)"
  xs = bw["samples_Bps"]
  return f"{bw['median_Bps'] / 1e9:.1f} ({min(xs) / 1e9:.1f}–{max(xs) / 1e9:.1f})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(r) + " |" for r in rows])


def markdown(result: dict, plot_name: str = "") -> str:
  meta, lim = result["meta"], result["meta"]["limits"]
  start, end = meta["machine_start"], meta.get("machine_end", {})
  bw, mm = lim["read_bandwidth"], lim["matmul"]
  labels = list(meta["methods"]) + list(meta["peers"])
  ref = meta["reference"]
  runs = meta.get("merged_runs")
  if runs:
    lines = [f"Merged from {len(runs)} runs (each cell is one run's; within a cell every method is interleaved):", ""]
    for r in runs:
      lines += [f"- `{r['command']}`", f"  cells {', '.join(r['cells']) or 'none'}; "
                f"{r.get('prefill_rounds', meta['prefill_rounds'])} prefill(s) per method and cell; read bandwidth "
                f"{r['limits']['read_bandwidth']['best_Bps'] / 1e9:.1f} GB/s; load average at start "
                f"{r['machine_start'].get('load_average_1_5_15')}, at end {r['machine_end'].get('load_average_1_5_15')}"]
    lines += ["", "# Ours vs HF transformers on the same model, prompts and contexts (interleaved within each cell)",
              "", "- machine limits and parity below: the first run's"]
  else:
    lines = [f"`{meta.get('command', '')}`", "", "# Ours vs HF transformers on the same model, prompts and contexts "
             "(one interleaved run)", ""]
  lines += [
           f"- model: {meta['model']} = {meta['model_source']} ({meta['dtype']}); the peer: transformers {meta['versions']['transformers']}"
           f" + torch {meta['versions']['torch']} (optimum-quanto {meta['versions']['optimum-quanto']}) on "
           f"{meta['hf_device']}, attention `{meta['hf_attn']}`, weights `{meta['hf_weights']}`",
           f"- threads: JAX's CPU backend {lim['jax_cpu_threads']} (the cores this process may use), torch "
           f"{lim['torch_threads']}; jax {meta['versions']['jax']}; {start.get('cpu_count')} CPUs on "
           f"{start.get('host')}",
           f"- read bandwidth {bw['best_Bps'] / 1e9:.1f} GB/s (best of " + ", ".join(
               f"{k[:-4]} {bw[k] / 1e9:.1f}" for k in bw['best_of']) + f"; float32 sum over "
           f"{bw['bytes'] / 2**30:.2f} GiB, best of {bw['repeats']}); fp32 GEMM {mm['best_flops'] / 1e9:.1f} GFLOP/s "
           f"(jax {mm['jax_flops'] / 1e9:.1f}" + (f", torch {mm['torch_flops'] / 1e9:.1f}" if 'torch_flops' in mm
                                                  else "") + f"; n={mm['n']})",
           f"- load average (1/5/15 min) at start {start.get('load_average_1_5_15')}, at end "
           f"{end.get('load_average_1_5_15')}; wall time {meta.get('seconds', 0):.0f} s",
           "- prompts: " + ("seeded random tokens" if meta.get("prompts", "random") == "random" else
                            f"consecutive windows of the `{meta['prompts']}` text") + " (the same for every method)",
           f"- timing: per cell every method (ours and the peer's) prefills {meta['prefill_rounds']}× in rotating "
           f"order (time to the first token; ours compiled beforehand), decodes {meta['warmup']} warm-up steps, "
           f"then {meta['rounds']} rounds of {meta['decode_steps']} greedy steps back to back, one method after "
           "the other in rotating order; medians over rounds. Speed ratios are to "
           f"`{ref}` in the same cell: decode = tok/s ÷ its tok/s (> 1 faster), prefill = seconds ÷ its seconds "
           "(< 1 faster)",
           "- bytes/step = weights + the cache the method attends at the cell's context (from shapes); × floor = "
           "step time ÷ (bytes/step ÷ the cell's read bandwidth: measured after every decode round of the cell, "
           "between the methods, as above but best of 3; median over the rounds; cells without it use the run's); "
           "compute floor = the step's FLOPs (every weight product for each query row — SpeCache decodes 1 + its "
           "candidates (2 by default) per sequence — and attention "
           "counted as dense fp math) ÷ GEMM rate; × roofline = step time ÷ the larger floor; prefill × floor = prefill time ÷ (FLOPs ÷ GEMM rate)",
           ""]
  par = result["parity"]
  lines += ["## The two sides run the same model", "",
            f"Greedy tokens, ours (`sj.generate`, full cache) vs the peer (DynamicCache), {par['batch']} random "
            f"prompts of {par['prompt_len']} tokens, {par['new_tokens']} new tokens each: **{par['equal']}/"
            f"{par['total']} equal** (first mismatch per row: {par['first_mismatch_per_row']}).", ""]
  cells = [c for c in result["cells"] if "methods" in c]
  heads = [f"{c['context']}/B{c['batch']}" for c in cells]
  if any("read_bandwidth" in c for c in cells):
    lines += ["## Read bandwidth while each cell ran (GB/s, median of its rounds; min–max)", ""] + _table(
        heads, [[_cell_bw(c) for c in cells]]) + [""]
  rows = []
  for label in labels:
    row = [label]
    for c in cells:
      r = c["methods"].get(label, {})
      row.append(f"{r['tokens_per_s']:.1f} ({_f(r.get('decode_speed_vs_ref'))}×)" if "step_s" in r else "skipped")
    rows.append(row)
  lines += [f"## Decode tok/s (× `{ref}`)", ""] + _table(["method"] + heads, rows) + [""]
  rows = []
  for label in labels:
    row = [label]
    for c in cells:
      r = c["methods"].get(label, {})
      row.append(f"{r['prefill_s']:.2f} ({_f(r.get('prefill_time_vs_ref'))}×)" if "step_s" in r else "skipped")
    rows.append(row)
  lines += [f"## Prefill seconds, time to first token (time × `{ref}`'s)", ""] + _table(["method"] + heads, rows)
  rows = []
  for c in result["cells"]:
    for label, r in c.get("methods", {}).items():
      if "step_s" not in r:
        rows.append([str(c["context"]), str(c["batch"]), label, f"skipped: {r.get('skipped')}"] + [""] * 10)
        continue
      rows.append([str(c["context"]), str(c["batch"]), label, f"{r['prefill_s']:.2f}",
                   _f(r.get("prefill_x_floor"), "{:.1f}"), f"{r['step_s'] * 1e3:.3g}", f"{r['tokens_per_s']:.1f}",
                   _f(r.get("decode_speed_vs_ref")), f"{_size(r['weight_bytes_per_step'])} + "
                   f"{_size(r['cache_bytes_per_step'])}", f"{r['floor_step_s'] * 1e3:.3g}",
                   _f(r.get("x_floor")), _f(_ms(r.get("compute_floor_step_s")), "{:.3g}"),
                   _f(r.get("x_roofline"))])
    if "skipped" in c:
      rows.append([str(c["context"]), str(c["batch"]), "all", f"skipped: {c['skipped']}"] + [""] * 10)
  misses = [f"{c['context']}/B{c['batch']} {label} {r['speculation_miss_rate']:.0%}" for c in result["cells"]
            for label, r in c.get("methods", {}).items() if "speculation_miss_rate" in r]
  if misses:
    lines += ["", "Speculation misses (offloaded methods with exact_on_miss: the rows whose guesses all missed, "
              "each a synchronous fetch of every layer's κ, over every decoded step incl. warm-up): "
              + ", ".join(misses) + "."]
  lines += ["", "## Every cell", ""] + _table(
      ["S", "B", "method", "prefill s", "prefill × floor", "ms/step", "tok/s", f"decode × {ref}",
       "bytes/step (weights + cache)", "floor ms", "× floor", "compute floor ms", "× roofline"], rows) + [""]
  lines += ["## Issue 10's targets on this run", ""] + _table(
      ["rule", "met", "values"],
      [[t["rule"], {True: "**met**", False: "**not met**", None: "not measured"}[t["met"]],
        ", ".join(f"{k} {_f(v)}" for k, v in t["values"].items())] for t in result["targets"]]) + [""]
  sc = result.get("scaling")
  if sc:
    lines += [f"## Decode step vs context (ours; {sc['model']}, batch {sc['batch']}, cache filled from random "
              "K/V; timing only)", ""]
    names = list(dict.fromkeys(l for p in sc["points"] for l in p["methods"]))
    rows = []
    for p in sc["points"]:
      row = [str(p["context"])]
      for l in names:
        r = p["methods"].get(l, {})
        row.append(f"{r['step_s'] * 1e3:.1f} ({r['x_floor']:.1f}× floor)" if "step_s" in r
                   else (r.get("skipped") or p.get("skipped", "—")))
      rows.append(row + [_cell_bw(p)])
    lines += _table(["S"] + [f"{l} ms" for l in names] + ["read GB/s"], rows) + [""]
    if plot_name:
      lines += [f"![step time vs context]({plot_name})", ""]
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """Step time vs context for each of our methods (solid) with its bandwidth floor (dotted), the weights-only
  floor (dashed), and the peer's DynamicCache step at batch `scaling.batch` from the table (markers)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sc, bw = result["scaling"], result["meta"]["limits"]["read_bandwidth"]["best_Bps"]
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  names = list(dict.fromkeys(l for p in sc["points"] for l in p["methods"]))
  for i, label in enumerate(names):
    pts = [(p["context"], p["methods"][label]) for p in sc["points"] if "step_s" in p["methods"].get(label, {})]
    if not pts:
      continue
    color = f"C{i}"
    ax.plot([s for s, _ in pts], [r["step_s"] * 1e3 for _, r in pts], "o-", color=color, label=label)
    ax.plot([s for s, _ in pts], [r["floor_step_s"] * 1e3 for _, r in pts], ":", color=color)
  xs = [p["context"] for p in sc["points"]]
  ax.axhline(sc["weight_bytes_per_step"] / bw * 1e3, color="k", ls="--", lw=1, label="floor: weights only")
  ref = result["meta"]["reference"]
  peer = [(c["context"], c["methods"][ref]["step_s"]) for c in result["cells"]
          if c.get("batch") == sc["batch"] and "step_s" in c.get("methods", {}).get(ref, {})]
  if peer:
    ax.plot([s for s, _ in peer], [t * 1e3 for _, t in peer], "kx", ms=9, mew=2, label=f"{ref} (table)")
  ax.set_xscale("log", base=2)
  ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
  ax.set_yscale("log")
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("decode step (ms), log scale")
  ax.set_title(f"Decode step vs context, batch {sc['batch']} (dotted: each method's bandwidth floor at "
               f"{bw / 1e9:.0f} GB/s)", fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
