"""The capped-throughput result as markdown (the table of max batch, tokens/s and ratios) and a plot (throughput
against batch per context, each method's max batch under the cap marked)."""
from __future__ import annotations

import os

from experiments.lib import report as exp_report
from experiments.lib.bench import report as bench_report
from experiments.lib.store import atomic_write_text


def _num(x, fmt: str) -> str:
  return "—" if x is None else format(x, fmt)


def _cap(meta: dict) -> str:
  return f"{meta['cap_gib']:g} GiB" if meta["cap_gib"] >= 1 else f"{meta['cap_bytes'] / 2**20:.4g} MiB"


def markdown(result: dict, plot_name: str | None = None) -> str:
  meta = result["meta"]
  start, end = meta["machine_start"], meta["machine_end"]
  lines = [f"# Decode throughput under a {_cap(meta)} device-memory cap", "",
           f"- command: `{meta.get('command', '')}`",
           f"- commit: {meta.get('commit', '')}; date: {start.get('time')}",
           f"- model: {meta['model']} ({meta['dtype']}); machine: {start.get('device')} on {start.get('host')}, "
           f"{start.get('cpu_count')} CPUs, jax {start.get('jax')}",
           f"- load average (1/5/15 min) at start {start.get('load_average_1_5_15')}, at end "
           f"{end.get('load_average_1_5_15')}; wall time {meta.get('seconds', 0):.0f} s",
           f"- cap: {_cap(meta)} = {meta['cap_bytes']} bytes. {meta['cap_note']}",
           *([f"- {meta['note']}"] if meta.get("note") else []),
           f"- device bytes = weights + the method's device state + the prefill activations of "
           f"{meta['prefill_rows']} sequence(s) at a time (every method; `specache_jax.memory_plan.plan_memory`); "
           "max batch = the largest batch whose bytes fit (batch + 1 does not).",
           f"- decode: greedy, {meta['warmup']} warm-up steps then {meta['rounds']} rounds of {meta['steps']} steps "
           "back to back, median seconds per step; tok/s = batch / step. Every row of a batch is a copy of one "
           "prefilled random prompt (one prefill per context for all methods and batches). Offloaded methods "
           "decode through the offloaded runtime with the host store real; the others with one jitted step per "
           f"token. Ratios are to `{meta['reference']}` at its own max batch in the same context.", ""]
  head = ["context", "method", "max batch", "× batch", "device GiB at max (weights + cache + act.)",
          "host GiB at max", "tok/s at max", "× tok/s"]
  rows = []
  for ctx in result["contexts"]:
    for label, p in ctx["plans"].items():
      if "skipped" in p:
        rows.append([ctx["context"], label, f"skipped: {p['skipped']}"] + [""] * 5)
        continue
      at = p["at_max"]
      parts = ("—" if not at else f"{at['device_bytes'] / 2**30:.3f} ({at['weights_bytes'] / 2**30:.3f} + "
               f"{at['cache_bytes'] / 2**30:.3f} + {at['activation_bytes'] / 2**30:.3f})")
      rows.append([ctx["context"], label, p["max_batch"] or "0 (batch 1 over the cap)",
                   bench_report._x(p.get("max_batch_ratio")), parts,
                   "—" if not at else f"{at['host_bytes'] / 2**30:.3f}",
                   _num(p.get("tokens_per_s_at_max"), ".1f"), bench_report._x(p.get("tokens_per_s_ratio"))])
  lines += ["## Max batch and throughput at it", "", exp_report.md_table(head, rows, "r" + "l" + "r" * 6), ""]
  cells = []
  for ctx in result["contexts"]:
    for label, recs in ctx.get("measured", {}).get("methods", {}).items():
      for r in recs:
        text = (f"skipped: {r['skipped']} | | | | " if "skipped" in r else
                f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.1f} | {r['state_bytes_measured'] / 2**20:.1f} | "
                f"{r['planned_device_bytes'] / 2**20:.1f} | {_num(r.get('speculation_miss_rate'), '.2f')}")
        cells.append(f"| {ctx['context']} | {label} | {r['batch']}{' (max)' if r['is_max'] else ''} | {text} |")
  if cells:
    prefill = ", ".join(f"{c['context']}: " + (f"{c['measured']['prefill_s']:.1f} s" if "prefill_s" in c["measured"]
                                                else c["measured"].get("skipped", "not run"))
                        for c in result["contexts"] if "measured" in c)
    lines += ["## Every measured batch", "", f"The one prefill per context (one sequence): {prefill}.", "",
              "| context | method | batch | ms/step | tok/s | state MiB (measured) | planned device MiB | "
              "speculation miss rate |", "|---:|---|---:|---:|---:|---:|---:|---:|"] + cells + [""]
  if plot_name:
    lines += [f"![throughput against batch]({plot_name})", ""]
  elif plot_name is None and not meta.get("plan_only"):
    lines += ["(no plot: matplotlib is not installed)", ""]
  return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
  """Throughput against batch, one panel per measured context, each method's max batch marked; False without
  matplotlib or with nothing measured."""
  contexts = [c for c in result["contexts"] if any("tokens_per_s" in r for recs in c.get("measured", {}).get(
      "methods", {}).values() for r in recs)]
  if not contexts:
    return False
  try:
    plt = exp_report.pyplot()
    from matplotlib import ticker
  except ImportError:
    return False
  fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
  for ax, ctx in zip(axes[0], contexts):
    for label, recs in ctx["measured"]["methods"].items():
      pts = sorted((r["batch"], r["tokens_per_s"]) for r in recs if "tokens_per_s" in r)
      if not pts:
        continue
      line, = ax.plot(*zip(*pts), marker="o", label=label)
      top = [(r["batch"], r["tokens_per_s"]) for r in recs if r["is_max"] and "tokens_per_s" in r]
      if top:
        ax.plot(*top[0], marker="*", markersize=16, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"context {ctx['context']}; ★ = max batch under {_cap(result['meta'])}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def write(out: str, result: dict) -> str:
  """<out>.json, <out>.png (when matplotlib is installed and something was measured) and <out>.md; returns the
  markdown."""
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  png = out + ".png"
  plotted = plot(result, png)
  result["meta"]["plot"] = os.path.basename(png) if plotted else None
  text = markdown(result, os.path.basename(png) if plotted else None)
  atomic_write_text(out + ".json", bench_report.dumps(result))
  atomic_write_text(out + ".md", text + "\n")
  return text
