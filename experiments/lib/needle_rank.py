"""Where the needle's rows rank: issue 14's miss anatomy at the step that matters (can any choice of k rows
find the needle, given the low-bit scores?).

For each NIAH cell (length, depth, needle) the chat-formatted prompt and the full cache's greedy answer run
through the model in one causal pass without a cache (teacher-forced). At the rows that write the answer (the
prompt's last row and every answer row but the last), each layer's real queries score the earlier positions:
  exact        q·k over the 16-bit keys (what the full cache attends)
  <rule>       q·k̂ over the keys as a SpeCache low-bit copy holds them: `quant.quantize_keys` with per-channel
               groups of g tokens over the prompt's first ⌊(n − residual) / g⌋·g positions; the rest (the ring,
               the answer rows) stay 16-bit
softmax per query head, averaged over the G query heads of each KV head (what κ's top-k ranks, selection.py).
A needle's rank is the best (smallest) rank of any of its token positions: 1 = the top; ties rank together.
These are the real query's scores, the best case for selection (no speculation): where the needle falls past
k here, no κ policy that ranks by the low-bit scores fetches it at that (layer, KV head).

Metrics per (cell, rule): of the (layer, KV head, answer row) triples whose exact rank is ≤ k (the heads that
find the needle: "retrieving"), the share whose low-bit rank is ≤ k too (`recall_at_k`), and the median low-bit
rank over them; per layer, the median rank over KV heads and rows (the plot).
"""
from __future__ import annotations

import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import models, niah, report
from experiments.lib.store import ResultStore, SweepResult, atomic_write_text, fingerprint
from specache_jax import quant
from specache_jax.caches import attention as A
from specache_jax.errors import ConfigError
from specache_jax.model import decoder as dec

RULES = {                      # rule label -> (bits, quant.py's one_bit rule)
    "1bit_specache": (1, "specache"),   # the paper's 1-bit levels (SpeCache-1bit, the faithful method)
    "1bit_kivi": (1, "kivi"),           # KIVI's 1-bit levels (m, M)
    "2bit": (2, "specache"),            # SpeCache-2bit's (KIVI's 2-bit) levels
}


def parse_rules(text: str) -> list[str]:
  rules = [r.strip() for r in str(text).split(",") if r.strip()]
  bad = [r for r in rules if r not in RULES]
  if not rules or bad:
    raise ConfigError(f"rules={text!r}: each must be one of {sorted(RULES)}")
  return rules


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer(lp, x_BTD, lengths_B, rope, *, cfg):
  """One layer of the cache-free causal forward -> (next x, q [B,T,N,H], k [B,T,K,H])."""
  q, k, v = dec.attention_inputs(cfg, lp, x_BTD, rope)
  attn, _ = A.prefill_attention(q, k, v, lengths_B, cfg.head_dim ** -0.5, False)
  return dec.layer_output(cfg, lp, x_BTD, attn), q, k


def queries_and_keys(model, tokens: list[int], rows: np.ndarray):
  """Each layer's queries at `rows` [L, R, N, H] and keys at every position [L, T, K, H] (float32, post-RoPE)."""
  cfg = model.config
  toks = jnp.asarray(tokens, jnp.int32)[None]
  lengths = jnp.asarray([len(tokens)], jnp.int32)
  x = dec.embed(model.params, toks)
  rope = dec.rope_for(cfg, "prefill", lengths, len(tokens))
  qs, ks = [], []
  for lp in dec.unstack_layers(model.params["layers"], cfg.n_layers):
    x, q, k = _layer(lp, x, lengths, rope, cfg=cfg)
    qs.append(np.asarray(q[0, rows], np.float32))
    ks.append(np.asarray(k[0], np.float32))
  return np.stack(qs), np.stack(ks)


def lowbit_keys(k_TKH: np.ndarray, n_prompt: int, bits: int, one_bit: str, group_size: int, residual: int):
  """The keys as the low-bit copy scores them: the first ⌊(n_prompt − residual) / g⌋·g positions quantized
  and dequantized, the rest as they are."""
  n_q = max(0, (n_prompt - residual) // group_size * group_size)
  out = np.array(k_TKH, np.float32)
  if n_q:
    k_BKSH = jnp.asarray(k_TKH[:n_q].transpose(1, 0, 2))[None]
    qk = quant.quantize_keys(k_BKSH, bits, group_size, one_bit, dtype=jnp.float32)
    out[:n_q] = np.asarray(quant.dequantize_keys(qk, bits, group_size))[0].transpose(1, 0, 2)
  return out


def needle_ranks(q_RNH: np.ndarray, k_TKH: np.ndarray, rows: np.ndarray, span: tuple[int, int]) -> np.ndarray:
  """The needle's rank [R, K] in each KV head's group-averaged attention of each row (positions <= the row)."""
  r, n, h = q_RNH.shape
  t, kh, _ = k_TKH.shape
  g = n // kh
  logits = np.einsum("rkgh,tkh->rkgt", q_RNH.reshape(r, kh, g, h).astype(np.float64),
                     k_TKH.astype(np.float64)) * h ** -0.5
  logits = np.where(np.arange(t)[None, None, None, :] <= rows[:, None, None, None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True)).mean(2)                                    # [R, K, T]
  best = p[..., span[0]:span[1]].max(-1)                                        # the needle's best position
  return 1 + (p > best[..., None]).sum(-1)


def cell_ranks(model, case, answer_ids: list[int], rules: list[str], group_size: int, residual: int) -> dict:
  """rule ("exact" and each of `rules`) -> needle ranks [L, R, K] for one case."""
  tokens = list(case.prompt_ids) + list(answer_ids)
  n = len(case.prompt_ids)
  rows = np.arange(n - 1, n - 1 + max(1, len(answer_ids)))        # the rows that write the answer
  q, k = queries_and_keys(model, tokens, rows)
  out = {"exact": np.stack([needle_ranks(q[l], k[l], rows, case.needle_span) for l in range(len(q))])}
  for rule in rules:
    bits, one_bit = RULES[rule]
    out[rule] = np.stack([needle_ranks(q[l], lowbit_keys(k[l], n, bits, one_bit, group_size, residual), rows,
                                       case.needle_span) for l in range(len(q))])
  return out


def summarize(ranks: dict, topk: int) -> dict:
  """Per rule: recall_at_k and median rank over the retrieving triples (exact rank <= k), their count, and the
  median rank per layer over KV heads and rows."""
  exact = np.asarray(ranks["exact"])
  retrieving = exact <= topk
  out = {"retrieving": int(retrieving.sum()), "triples": int(exact.size)}
  for rule, r in ranks.items():
    r = np.asarray(r)
    out[rule] = {"recall_at_k": float((r[retrieving] <= topk).mean()) if retrieving.any() else None,
                 "median_rank_retrieving": float(np.median(r[retrieving])) if retrieving.any() else None,
                 "median_rank_by_layer": np.median(r.reshape(r.shape[0], -1), axis=1).tolist()}
  return out


def run(config, model=None, command: str = "python -m experiments.needle_rank --config=configs/needle_rank.py",
        log=print) -> SweepResult:
  start = time.time()
  model = model or models.load(config.model, config.dtype)
  rules = parse_rules(config.rules)
  lengths, depths = niah.grid(config)
  specs = niah.needles(config)
  stops = models.stop_ids(model)
  store = ResultStore(pathlib.Path(config.output_dir) / "results.json",
                      meta={"experiment": "needle_rank", "command": command})
  computed = skipped = 0
  for key in specs:
    cases = niah.build_cases(config, model.tokenizer, lengths, depths, key)
    for (n, d), case in report.progress(list(cases.items()), desc=f"needle rank {key or 'needle'}"):
      cid = niah.cell_id("rank", n, d, key)
      fp = fingerprint(niah.needle_fingerprint(config, key), rules, config.group_size, config.residual,
                       config.max_new_tokens)
      if store.done(cid, fp):
        skipped += 1
        continue
      t0 = time.time()
      toks, nums, _ = models.generate_rows(model, [list(case.prompt_ids)], max_new_tokens=config.max_new_tokens,
                                           cache="full", stop_tokens=stops)
      answer_ids = [int(t) for t in np.asarray(toks[0])[:int(nums[0])] if int(t) not in stops]
      ranks = cell_ranks(model, case, answer_ids, rules, config.group_size, config.residual)
      answer = models.decode_answer(model.tokenizer, toks[0], int(nums[0]), stops)
      rec = dict(length=n, depth=d, needle=key, needle_span=list(case.needle_span),
                 prompt_tokens=len(case.prompt_ids), answer=answer, full_correct=bool(case.check(answer)),
                 ranks={r: np.asarray(v).tolist() for r, v in ranks.items()},
                 summary=summarize(ranks, config.topk), seconds=time.time() - t0)
      store.put_many({cid: rec}, fp)
      computed += 1
      log(f"needle rank {key or 'needle'} @ {n}/{d}: " + ", ".join(
          f"{r} recall@{config.topk} {rec['summary'][r]['recall_at_k']}" for r in rules))
  table = write_outputs(config, store, rules, command, time.time() - start)
  return SweepResult(table, store.cells, computed, skipped, time.time() - start)


def _fmt(x, spec=".2f"):
  return "–" if x is None else format(x, spec)


def write_outputs(config, store, rules, command, seconds) -> str:
  """summary.md (per cell: retrieving triples, each rule's recall at k and median rank) and needle_rank.png."""
  cells = sorted(store.cells.values(), key=lambda c: (c["needle"], c["length"], c["depth"]))
  k = config.topk
  headers = ["needle", "length@depth", "full cache's answer", "retrieving triples"] + [
      f"{r}: recall@{k} (median rank)" for r in rules]
  rows = []
  for c in cells:
    s = c["summary"]
    rows.append([c["needle"] or "(config)", f"{c['length']}@{c['depth']}", "✓" if c["full_correct"] else "✗",
                 f"{s['retrieving']}/{s['triples']}"] +
                [f"{_fmt(s[r]['recall_at_k'])} ({_fmt(s[r]['median_rank_retrieving'], '.0f')})" for r in rules])
  pooled = []
  for r in rules:
    hits = tot = 0
    for c in cells:
      ex, rr = np.asarray(c["ranks"]["exact"]), np.asarray(c["ranks"][r])
      hits += int(((ex <= k) & (rr <= k)).sum())
      tot += int((ex <= k).sum())
    pooled.append(f"{r} {hits / max(tot, 1):.2f}")
  notes = [f"Model `{config.model}`; group size {config.group_size}, residual {config.residual}, k = {k}; the full "
           f"cache's greedy answer (at most {config.max_new_tokens} tokens) teacher-forced.",
           "A triple is (layer, KV head, answer row); 'retrieving': its exact (16-bit) needle rank is ≤ k. recall@k: "
           "the share of the retrieving triples whose low-bit rank is ≤ k too (the real query's: no speculation). "
           f"Pooled over every cell: {', '.join(pooled)}.",
           f"Wall time of this invocation: {seconds:.0f} s."]
  text = report.header("Needle rank in the low-bit scores", command, notes) + "\n" + report.md_table(headers, rows)
  out = pathlib.Path(config.output_dir)
  atomic_write_text(out / "summary.md", text)
  _plot(cells, ["exact"] + rules, k, out / "needle_rank.png")
  return text


def _plot(cells, rules, k, path) -> None:
  if not cells:
    return
  plt = report.pyplot()
  lengths = sorted({c["length"] for c in cells})
  fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), sharey=True, squeeze=False)
  for ax, n in zip(axes[0], lengths):
    group = [c for c in cells if c["length"] == n]
    for r in rules:
      med = np.median(np.stack([np.asarray(c["summary"][r]["median_rank_by_layer"]) for c in group]), axis=0)
      ax.plot(np.arange(len(med)), med, marker=".", label=r)
    ax.axhline(k, color="gray", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_title(f"{n} tokens ({len(group)} cells)")
    ax.set_xlabel("layer")
  axes[0][0].set_ylabel("needle rank (median)")
  fig.suptitle(f"The needle's best rank in the real query's attention, per layer: median over KV heads, answer rows "
               f"and cells; dashed: k = {k}", fontsize=9)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
