"""Markdown tables of the benchmark result dicts (what goes next to the JSON under results/)."""
from __future__ import annotations

import json
from typing import Any


def _ms(s: float | None) -> str:
  return "—" if s is None else (f"{s * 1e3:.1f}" if s < 10 else f"{s:.1f} s")


def _x(r: float | None) -> str:
  return "—" if r is None else f"{r:.2f}×"


def _mb(n: int | None) -> str:
  return "—" if n is None else f"{n / 2**20:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(r) + " |" for r in rows])


def _machine(meta: dict) -> list[str]:
  start, end = meta.get("machine_start", {}), meta.get("machine_end", {})
  return [f"- model: {meta.get('model')} ({meta.get('dtype')})",
          f"- machine: {start.get('device')} on {start.get('host')}, {start.get('cpu_count')} CPUs, jax "
          f"{start.get('jax')}, XLA_FLAGS=`{start.get('xla_flags')}`",
          f"- load average (1/5/15 min) at start {start.get('load_average_1_5_15')}, at end "
          f"{end.get('load_average_1_5_15')} (other jobs shared the machine when it is above ~0)",
          f"- wall time {meta.get('seconds', 0):.0f} s; command: `{meta.get('command', '')}`"
          + (f"; commit: {meta['commit']}" if meta.get("commit") else "")]


def caches_markdown(result: dict) -> str:
  meta, cells = result["meta"], result["cells"]
  labels = list(meta["methods"])
  lines = ["# Decode step time per cache method", ""] + _machine(meta) + [
      f"- a step = the decoding loop's step (`throughput.decode_step_jit`: per-layer weights, the per-layer cache "
      f"donated, the greedy next input) on a prefilled cache, median of "
      f"{meta['iters']} blocked calls after {meta['warmup']} warm-up calls, the methods of a cell interleaved "
      f"(one step each per round, rotating order); ratio = method / `{meta['reference']}` in the same cell", ""]
  head = ["method"] + [f"S={c['context']} B={c['batch']}" for c in cells]

  def step(c, rec):
    if "step" in rec:
      return f"{_ms(rec['step']['median_s'])} ms ({_x(rec.get('step_ratio'))})"
    return f"skipped: {rec.get('skipped') or c.get('skipped', 'not run')}"

  def mib(key):
    return lambda c, rec: f"{_mb(rec.get(key))} MiB ({_x(rec.get(key + '_ratio'))})" if key in rec else "—"

  def rows(cell_text):
    return [[label] + [cell_text(c, c["methods"].get(label, {})) for c in cells] for label in labels]

  lines += ["## Step time (ms) and ratio to full", ""] + _table(head, rows(step)) + [""]
  lines += ["## Device bytes of the cache state (MiB) and ratio to full", "",
            "Measured with each method's `device_bytes` on its real state arrays (SpeCache: everything but "
            "the 16-bit cache, which belongs to host memory; in the simulated mode it is a device array read "
            "only through the κ gather).", ""] + _table(head, rows(mib("device_bytes"))) + [""]
  lines += ["## The same with a bfloat16 model (the paper's 16-bit setting), from the state shapes", "",
            "Each method rebuilt for a bfloat16 model (eviction budgets re-matched) and sized with "
            "`caches.budget.device_bytes_at` (eval_shape; nothing allocated or timed).", ""]
  lines += _table(head, rows(mib("device_bytes_16bit"))) + [""]
  tgt = result.get("target", {})
  verdict = {True: "**met**", False: "**not met**", None: "not measured"}[tgt.get("met")]
  lines += ["## Target", "", f"{tgt.get('rule')}: {verdict} — ratios {json.dumps(tgt.get('ratios'))}", ""]
  for prof in result.get("profiles", []):
    if "pieces" not in prof:
      lines += [f"## Profile (batch {prof.get('batch')})", "", f"skipped: {prof.get('skipped')}", ""]
      continue
    lines += [f"## Where a SpeCache step goes ({prof.get('label')}, S={prof['context']}, B={prof['batch']})", "",
              f"Whole step: SpeCache {_ms(prof['step_specache_s'])} ms, full {_ms(prof['step_full_s'])} ms. "
              f"Passing the stacked state through the layer scan once: SpeCache "
              f"{_ms(prof['scan_copy_specache_s'])} ms ({_mb(prof['state_bytes_specache'])} MiB), full "
              f"{_ms(prof['scan_copy_full_s'])} ms ({_mb(prof['state_bytes_full'])} MiB).", "",
              prof["note"], ""]
    rows = [[k, _ms(v["per_layer_s"]), _ms(v["x_layers_s"])] for k, v in prof["pieces"].items()]
    lines += _table(["piece", "ms per layer", "ms × layers"], rows) + [""]
  return "\n".join(lines)


def throughput_markdown(result: dict) -> str:
  meta, cells = result["meta"], result["cells"]
  lines = ["# Generation throughput: prefill and decode, device/host bytes, fetch overlap", ""] + _machine(meta)
  lines += [f"- decode: greedy, {meta['warmup']} warm-up steps, then {meta.get('rounds', 1)} rounds of "
            f"{meta['decode_steps']} steps timed back to back (no host sync between steps), the methods of a "
            "cell taking turns round by round; step = median over rounds; prefill (+ SpeCache's pre-decoding "
            "pass): a compiled run (jitted methods: compiled ahead of "
            "time; offloaded runtime: the second of two runs); ratios are to "
            f"`{meta['reference']}` in the same (context, batch) cell", ""]
  head = ["S", "B", "method", "prefill s", "step ms", "tok/s", "tok/s ratio", "device MiB", "dev ratio",
          "host MiB", "H2D KiB/step", "D2H KiB/step"]
  rows = []
  for c in cells:
    for label, r in c["methods"].items():
      if "skipped" in r:
        rows.append([str(c["context"]), str(c["batch"]), label, f"skipped: {r['skipped']}"] + [""] * 8)
        continue
      rows.append([str(c["context"]), str(c["batch"]), label, f"{r['prefill_s']:.2f}",
                   _ms(r["step_s"]), f"{r['tokens_per_s']:.1f}", _x(r.get("tokens_per_s_ratio")),
                   _mb(r["device_bytes"]), _x(r.get("device_bytes_ratio")), _mb(r["host_bytes"]),
                   f"{r['h2d_bytes_per_step'] / 1024:.0f}", f"{r['d2h_bytes_per_step'] / 1024:.0f}"])
  lines += ["## Sweep", ""] + _table(head, rows) + [""]
  ov = result.get("overlap")
  if ov:
    lines += ["## Overlap of the κ fetch with compute (offloaded, speculative)", ""]
    if "skipped" in ov:
      lines += [f"skipped: {ov['skipped']}", ""]
    else:
      stores = ov["stores"]
      any_ = next(iter(stores.values()))
      pinned = (f", XLA's threads pinned to CPU {ov['xla_cpus']} (their affinity: {ov.get('xla_thread_cpus')})"
                if ov.get("xla_cpus") else "")
      lines += [f"S={any_['context']}, B={any_['batch']}, XLA_FLAGS=`{ov['xla_flags']}`{pinned}, {any_['rounds']} "
                f"rounds of {any_['steps']} steps (medians), model {ov.get('model')}.", "",
                "(a) compute alone: the offloaded step's own programs with every fetch answered by a block of "
                "rows held on the device (rows installed; no host gather, transfer or wait); (b) fetch alone: every layer group's host gather "
                "+ `device_put`, blocked; (c) the pipelined step; issue: the part of (b) the dispatching thread "
                "spends issuing the fetches; the dispatching thread's CPU: `time.thread_time` inside (c)'s step "
                "(per-group program dispatch and fetch issue, not its waits). Under these XLA flags the CPU "
                "kernels run on one thread too, and with XLA's threads pinned to one CPU (the flags alone left "
                "XLA:CPU's thunk executor running independent ops on a second thread) the host store's worker "
                "has the other core. "
                "Fraction hidden = (a + b − c) / b from each round's own a, b, c (a and c back to back, in "
                "alternating order), the median over rounds, clipped to [0, 1]; in brackets a 90% bootstrap "
                "interval of that median (b is a few % of a step: the machine's round-to-round noise in a and c "
                "moves the fraction by more than b).", ""]
      rows = [[name] + [_ms(st[key + "_s"]) for st in stores.values()]
              for name, key in (("(a) compute alone", "compute_alone"), ("(b) fetch alone", "fetch_alone"),
                                ("issue part of (b)", "fetch_issue"), ("(c) pipelined", "pipelined"))]
      rows.append(["(c) − (a) per round: median [90% interval]"] + [
          "{} [{}, {}]".format(_ms(st["pipelined_minus_compute_s"]), *map(_ms, st["pipelined_minus_compute_ci90_s"]))
          if "pipelined_minus_compute_s" in st else "—" for st in stores.values()])
      rows.append(["fraction hidden"] + [
          f"{st['fraction_hidden']:.2f} (raw {st['fraction_hidden_raw']:.2f}"
          + (", 90% interval [{:.2f}, {:.2f}])".format(*st["fraction_hidden_ci90"]) if "fraction_hidden_ci90" in st
             else ")") for st in stores.values()])
      rows.append(["dispatching thread's CPU per pipelined step (µs per layer)"] + [
          f"{_ms(st['dispatch_cpu_s'])} ({st['dispatch_cpu_us_per_layer']:.0f} µs)" if "dispatch_cpu_s" in st
          else "—" for st in stores.values()])
      lines += _table(["ms per step", *[f"store `{k}`" for k in stores]], rows) + [""]
      if ov.get("nonspeculative_step_s") is not None:
        lines += [f"Non-speculative step (κ chosen and fetched on the critical path, store "
                  f"`{ov['method'].get('host_store', 'auto')}`): {_ms(ov['nonspeculative_step_s'])} ms.", ""]
  return "\n".join(lines)


def dumps(result: Any) -> str:
  return json.dumps(result, indent=1, default=str) + "\n"
