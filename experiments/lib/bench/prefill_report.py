"""The markdown of a prefill benchmark report (experiments/lib/bench/prefill.py)."""
from __future__ import annotations


def markdown(report: dict) -> str:
  m = report["machines"][0]
  lines = ["# Prefill on the CPU: blockwise vs dense causal attention (SmolLM2-135M fp32, batch 1)", "",
           "Commands (run in this order; each merges its parts into the same report, a later part or context "
           "replacing an earlier one):", ""]
  lines += [f"    {c}" for c in report["commands"]]
  if report.get("source"):
    lines += ["", f"Code measured: {report['source']}"]
  lines += ["", f"Machine: {m['cpu_count']} CPU cores, jax {m['jax']}; runs started "
            f"{', '.join(x['time'] for x in report['machines'])} with load averages (1 min) "
            f"{', '.join(str(x['load_average_1_5_15'][:1]) for x in report['machines'])}. "
            "Times are medians, wall and process-CPU seconds (the machine is shared: CPU seconds say more "
            "than wall seconds when it is busy); the load average before → after each timing is given.", ""]
  if "check" in report:
    lines += [f"Check before timing (ragged batch, T=1000, lengths 1000/1/613): {report['check']}", ""]
  if "attention" in report:
    lines += ["## Attention alone (one layer, N=9, K=3, H=64)", "",
              "| T | old wall s | new wall s | new+colsum wall s | speed-up (wall) | old CPU s | new CPU s | "
              "new GFLOP/s | new GFLOP/CPU-s | load before → after |", "|---" * 10 + "|"]
    for t, r in report["attention"].items():
      lines.append(f"| {t} | {r['old']['wall_s']:.3f} | {r['new']['wall_s']:.3f} | {r['new+colsum']['wall_s']:.3f}"
                   f" | {r['old']['wall_s'] / r['new']['wall_s']:.1f}x | {r['old']['cpu_s']:.3f} | "
                   f"{r['new']['cpu_s']:.3f} | {r['new']['gflops_per_s']:.1f} | {r['new']['gflops_per_cpu_s']:.1f}"
                   f" | {r['load_average_before_after'][0][0]} → {r['load_average_before_after'][1][0]} |")
    lines.append("")
  if "model" in report:
    lines += ["## Whole-model prefill (30 layers, logits of the last row)", "",
              "| T | TFLOP (weights + attention) | old wall s | new wall s | speed-up | old CPU s | new CPU s | "
              "new GFLOP/s | new GFLOP/CPU-s | compile new s | load before → after |", "|---" * 11 + "|"]
    notes = []
    for t, r in report["model"].items():
      res, fl = r["results"], r["flops"]
      new, old = res["new"], res.get("old")
      if old:
        old_wall, old_cpu, mark = old["wall_s"], old["cpu_s"], ""
      else:     # the old model = the new one with each layer's attention swapped back, from the attention part
        attn = report.get("attention", {}).get(t)
        n_layers = report["n_layers"]
        old_wall = None     # wall seconds from runs under different loads do not add up
        old_cpu = new["cpu_s"] + n_layers * (attn["old"]["cpu_s"] - attn["new"]["cpu_s"]) if attn else None
        mark = " (est.)"
        if attn:
          notes.append(f"T={t}: the old model was not timed; its CPU seconds are estimated as the new model's plus "
                       f"{n_layers} x (old - new attention alone at T={t}).")
      speedup = (f"{old_wall / new['wall_s']:.1f}x (CPU {old_cpu / new['cpu_s']:.1f}x)" if old_wall else
                 f"CPU {old_cpu / new['cpu_s']:.1f}x{mark}" if old_cpu else "–")
      lines.append(
          f"| {t} | {fl['total'] / 1e12:.2f} ({fl['weights'] / 1e12:.2f} + {fl['attention'] / 1e12:.2f}) | "
          f"{f'{old_wall:.1f}{mark}' if old_wall else '–'} | {new['wall_s']:.1f} | {speedup} | "
          f"{f'{old_cpu:.1f}{mark}' if old_cpu else '–'} | {new['cpu_s']:.1f} | {new['gflops_per_s']:.1f} | "
          f"{new['gflops_per_cpu_s']:.1f} | {new['compile_s']:.1f} | {res['load_average_before_after'][0][0]} → "
          f"{res['load_average_before_after'][1][0]} |")
    cores = report["machines"][0]["cpu_count"]
    lines += [""] + notes + [
        f"Wall seconds here are inflated by the other jobs on this machine. With {cores} cores the XLA thread "
        f"pool can do at most {cores} CPU-seconds per second, so new CPU s / {cores} is a lower bound on the "
        "new model's wall time on an idle machine: "
        + ", ".join(f"T={t}: {r['results']['new']['cpu_s'] / cores:.1f} s" for t, r in report["model"].items())
        + ".", ""]
  if "layer" in report:
    r = report["layer"]
    lines += [f"## One layer at T={r['context']}: where the time goes", "",
              "| part | wall ms | CPU ms | GFLOP | GFLOP/s | GFLOP/CPU-s |", "|---" * 6 + "|"]
    for name, x in r.items():
      if name == "context":
        continue
      lines.append(f"| {name} | {x['wall_s'] * 1e3:.0f} | {x['cpu_s'] * 1e3:.0f} | {x['flops'] / 1e9:.1f} | "
                   f"{x['gflops_per_s']:.1f} | {x['gflops_per_cpu_s']:.1f} |")
    lines.append("")
  if "blocks" in report:
    r = report["blocks"]
    lines += [f"## Block sizes (attention alone, T={r['context']})", "",
              "| block_q x block_k | wall s | CPU s | GFLOP/s | GFLOP/CPU-s | compile s |", "|---" * 6 + "|"]
    for name, x in r["results"].items():
      if name.startswith("load"):
        continue
      lines.append(f"| {name} | {x['wall_s']:.3f} | {x['cpu_s']:.3f} | {x['gflops_per_s']:.1f} | "
                   f"{x['gflops_per_cpu_s']:.1f} | {x['compile_s']:.1f} |")
    lines += [f"Load before → after: {r['results']['load_average_before_after']}", ""]
  if "structure" in report:
    lines += ["## Loop structure (attention alone)", "",
              "| T | variant | compile s | wall s | CPU s | GFLOP/CPU-s |", "|---" * 6 + "|"]
    for t, res in report["structure"].items():
      for name, x in res.items():
        if not name.startswith("load"):
          lines.append(f"| {t} | {name} | {x['compile_s']:.1f} | {x['wall_s']:.3f} | {x['cpu_s']:.3f} | "
                       f"{x['gflops_per_cpu_s']:.1f} |")
    lines.append("")
  if "memory" in report:
    lines += ["## Whole-model prefill memory (XLA's temporary buffers, compile only)", "",
              "| T | old MB | new MB |", "|---" * 3 + "|"]
    for t, r in report["memory"].items():
      lines.append(f"| {t} | {r['old']['temp_bytes'] / 2**20:.0f} | {r['new']['temp_bytes'] / 2**20:.0f} |")
    lines.append("")
  if "gemm" in report:
    lines += ["## fp32 GEMM through XLA (the MLP's shapes)", "", "| m x k x n | wall ms | GFLOP/s | GFLOP/CPU-s |",
              "|---" * 4 + "|"]
    for name, x in report["gemm"].items():
      lines.append(f"| {name} | {x['wall_s'] * 1e3:.1f} | {x['gflops_per_s']:.1f} | {x['gflops_per_cpu_s']:.1f} |")
    lines.append("")
  return "\n".join(lines)
