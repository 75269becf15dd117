"""experiments/lib/needle_rank: the needle's rank in exact and low-bit attention, against loop references, and
the sweep end to end on the random tiny model."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from configs import needle_rank as needle_rank_cfg
from experiments.lib import models, needle_rank
from specache_jax import quant
from specache_jax.errors import ConfigError


def _loop_ranks(q, k, rows, span):
  """Rank of the needle's best position by loops: group-averaged softmax over positions <= the row."""
  r_n, n, h = q.shape
  t, kh, _ = k.shape
  g = n // kh
  out = np.zeros((r_n, kh), np.int64)
  for r in range(r_n):
    for j in range(kh):
      p = np.zeros(t)
      for gi in range(g):
        logits = np.array([q[r, j * g + gi] @ k[s, j] / np.sqrt(h) if s <= rows[r] else -np.inf
                           for s in range(t)])
        e = np.exp(logits - logits.max())
        p += e / e.sum() / g
      best = max(p[s] for s in range(*span))
      out[r, j] = 1 + sum(1 for s in range(t) if p[s] > best)
  return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_needle_ranks_match_a_loop_reference(seed):
  rng = np.random.default_rng(seed)
  t, kh, g, h = 40, 2, 3, 8
  q = rng.standard_normal((3, kh * g, h))
  k = rng.standard_normal((t, kh, h))
  rows = np.array([29, 34, 39])
  span = (5, 9)
  np.testing.assert_array_equal(needle_rank.needle_ranks(q, k, rows, span), _loop_ranks(q, k, rows, span))


def test_a_needle_key_along_its_heads_queries_ranks_first_and_a_future_one_never_does():
  rng = np.random.default_rng(3)
  base = rng.standard_normal((2, 16))                                  # one direction per KV head
  q = np.repeat(base, 2, axis=0)[None] + 0.05 * rng.standard_normal((2, 4, 16))   # [R=2, N=4 (G=2), H]
  k = rng.standard_normal((30, 2, 16)) * 0.1
  k[12] = 5 * base
  np.testing.assert_array_equal(needle_rank.needle_ranks(q, k, np.array([28, 29]), (12, 13)), np.ones((2, 2)))
  # a needle after the row is never attended: it ranks below every attended position
  np.testing.assert_array_equal(needle_rank.needle_ranks(q, k, np.array([10, 11]), (12, 13)), [[12, 12], [13, 13]])


def test_lowbit_keys_quantize_whole_groups_below_the_ring():
  rng = np.random.default_rng(4)
  k = rng.standard_normal((200, 3, 16)).astype(np.float32)
  out = needle_rank.lowbit_keys(k, n_prompt=190, bits=1, one_bit="specache", group_size=32, residual=64)
  n_q = (190 - 64) // 32 * 32                                          # 96: three whole groups
  qk = quant.quantize_keys(jnp.asarray(k[:n_q].transpose(1, 0, 2))[None], 1, 32, "specache", dtype=jnp.float32)
  want = np.asarray(quant.dequantize_keys(qk, 1, 32))[0].transpose(1, 0, 2)
  np.testing.assert_array_equal(out[:n_q], want)
  np.testing.assert_array_equal(out[n_q:], k[n_q:])
  assert not np.array_equal(out[:n_q], k[:n_q])
  short = needle_rank.lowbit_keys(k[:50], n_prompt=50, bits=2, one_bit="specache", group_size=32, residual=64)
  np.testing.assert_array_equal(short, k[:50])                          # shorter than the ring: all 16-bit


def test_summary_counts_retrieving_triples_and_recall():
  exact = np.array([[[1, 100]], [[3, 70]]])                            # [L=2, R=1, K=2]: 2 retrieving at k=64
  ranks = {"exact": exact, "1bit_specache": np.array([[[80, 5]], [[2, 1]]])}
  s = needle_rank.summarize(ranks, topk=64)
  assert s["retrieving"] == 2 and s["triples"] == 4
  assert s["1bit_specache"]["recall_at_k"] == 0.5 and s["1bit_specache"]["median_rank_retrieving"] == 41.0
  assert s["exact"]["recall_at_k"] == 1.0
  assert s["1bit_specache"]["median_rank_by_layer"] == [42.5, 1.5]


def test_bad_rules_are_named():
  with pytest.raises(ConfigError, match="3bit"):
    needle_rank.parse_rules("1bit_specache,3bit")


def test_needle_rank_end_to_end_and_rerun_reuses_cells(tmp_path):
  tiny = models.load("tiny-random")
  cfg = needle_rank_cfg.get_config("test")
  cfg.output_dir = str(tmp_path)
  cfg.rules = "1bit_specache,2bit"
  res = needle_rank.run(cfg, model=tiny, log=lambda *_: None)
  assert res.computed == 4 and res.skipped == 0
  for rec in res.records.values():
    exact = np.asarray(rec["ranks"]["exact"])
    assert exact.shape[0] == tiny.config.n_layers and exact.shape[2] == tiny.config.n_kv_heads
    assert exact.shape[1] >= 1 and exact.min() >= 1
    for rule in ("1bit_specache", "2bit"):
      assert np.asarray(rec["ranks"][rule]).shape == exact.shape
    lo, hi = rec["needle_span"]
    assert 0 <= lo < hi <= rec["prompt_tokens"]
  summary = (tmp_path / "summary.md").read_text()
  assert "1bit_specache: recall@64" in summary and "| (config) | 324@0.25 |" in summary
  assert (tmp_path / "needle_rank.png").stat().st_size > 0
  again = needle_rank.run(cfg, model=tiny, log=lambda *_: None)
  assert again.computed == 0 and again.skipped == 4
