"""Issue 14's ablation table joins the experiments' stores (experiments/lib/speculation.py): its numbers are the
stores' numbers, a missing store leaves '–' and the bar unmet, and the bar is checked as the issue states it."""
import json
import math

import pytest

from experiments.lib import speculation


def _write(path, cells):
  path.write_text(json.dumps({"meta": {}, "cells": cells}))
  return path


def _ppl_cell(method, window, nll_sum, count):
  return {"method": method, "window": window, "nll_sum": {"0–4k": 0.0, "4k–8k": nll_sum},
          "count": {"0–4k": 10, "4k–8k": count}}


def _stores(tmp_path, eom_niah=(True, True, True, False), eom_ruler=(1.0, 0.0), eom_nll=2.05):
  hit = _write(tmp_path / "hit.json", {
      "a": {"method": "specache_1bit", "exact_hit_rate": 0.6, "topk_hit_rate": 0.7},
      "b": {"method": "specache_1bit_eom", "exact_hit_rate": 0.3, "topk_hit_rate": 0.68, "sync_fetch_rate": 0.08}})
  cells = {}
  for i, full_ok in enumerate((True, True, True, False)):
    cells[f"f{i}"] = {"method": "full", "length": 1024, "depth": i / 4, "correct": full_ok}
  for i, eom_ok in enumerate(eom_niah):                 # fewer than full's 4: a run still going
    cells[f"e{i}"] = {"method": "specache_1bit_eom", "length": 1024, "depth": i / 4, "correct": eom_ok}
  niah = _write(tmp_path / "niah.json", cells)
  sample = lambda method, i, score: {"method": method, "task": "qa_1", "length": 4096, "index": i,   # noqa: E731
                                     "score": score}
  ruler = _write(tmp_path / "ruler.json", {
      "f0": sample("full", 0, 1.0), "f1": sample("full", 1, 0.0),
      **{f"e{i}": sample("specache_1bit_eom", i, x) for i, x in enumerate(eom_ruler)}})
  steps = tmp_path / "steps.json"
  steps.write_text(json.dumps({"cells": [{"context": 4096, "batch": 1, "methods": {
      "full": {"step_s": 0.03}, "specache_1bit_offload": {"step_s": 0.04},
      "specache_1bit_eom_offload": {"step_s": 0.05}}}]}))
  ppl = _write(tmp_path / "ppl.json", {                 # full: 2 windows pooled, mean NLL 2.0 over 4k-8k
      "full/w0": _ppl_cell("full", 0, 300.0, 100), "full/w1": _ppl_cell("full", 1, 100.0, 100),
      "specache_1bit_eom/w0": _ppl_cell("specache_1bit_eom", 0, 100 * eom_nll, 100),
      "specache_1bit_eom/w1": _ppl_cell("specache_1bit_eom", 1, 100 * eom_nll, 100)})
  return hit, niah, ruler, steps, ppl


def test_table_joins_the_stores_and_checks_the_bar(tmp_path):
  rows, md = speculation.table(*_stores(tmp_path))
  by = {r["label"]: r for r in rows}
  assert list(by) == ["specache_1bit", "specache_1bit_eom"]               # the faithful one first
  eom = by["specache_1bit_eom"]
  assert eom["niah"] == (3, 4) and eom["niah_vs_full"] == 1.0               # all 3 needles full retrieves
  assert eom["ruler"] == pytest.approx(50.0) and eom["ruler_vs_full"] == pytest.approx(1.0)
  assert eom["ppl"] == pytest.approx(math.exp(2.05)) and eom["ppl_vs_full"] == pytest.approx(math.exp(0.05))
  assert eom["step_ms"] == pytest.approx(50.0) and eom["step_vs_faithful"] == pytest.approx(1.25)
  assert eom["sync_fetch_rate"] == 0.08 and 0.05 < eom["bytes_vs_full"] < 0.12 and eom["meets"]
  faithful = by["specache_1bit"]
  assert faithful["sync_fetch_rate"] == 0.0 and "niah" not in faithful and not faithful["meets"]   # no NIAH cells
  assert "| specache_1bit | " in md and "| – | – |" in md and "full cache: NIAH 3/4" in md
  assert f"perplexity 4k–8k {math.exp(2.0):.2f}" in md


@pytest.mark.parametrize("niah, ruler, nll", [
    ((True, True, False, False), (1.0, 0.0), 2.0),    # 2 of full's 3 needles
    ((True, True, True, True), (0.5, 0.3), 2.0),      # RULER 80% of full's
    ((True, True, True, True), (1.0, 0.0), 2.1)])     # perplexity e^0.1 = 1.105x full's
def test_the_bar_is_not_met_when_one_limit_is_missed(tmp_path, niah, ruler, nll):
  rows, _ = speculation.table(*_stores(tmp_path, niah, ruler, nll))
  assert not {r["label"]: r for r in rows}["specache_1bit_eom"]["meets"]


def test_a_run_still_going_is_partial_not_its_average_so_far(tmp_path):
  """RULER or NIAH cells covering only part of the full cache's: no average, no ratio, the bar not met."""
  rows, md = speculation.table(*_stores(tmp_path, eom_niah=(True, True), eom_ruler=(1.0,)))
  eom = {r["label"]: r for r in rows}["specache_1bit_eom"]
  assert "ruler" not in eom and eom.get("ruler_vs_full") is None and eom["ruler_partial"] == (1, 2)
  assert eom.get("niah_vs_full") is None and eom["niah_partial"] == (2, 4) and not eom["meets"]
  assert "partial (1/2 of full's cells)" in md and "partial (2/4 of full's cells)" in md
  # a label that ran only the config's needle of a store where the full cache also ran a second one: whole grid
  cells = json.loads((tmp_path / "niah.json").read_text())["cells"]
  cells.update({f"x{i}": {"method": "full", "needle": "lighthouse", "length": 1024, "depth": i / 4, "correct": True}
                for i in range(4)})
  cells.update({f"e{i}": {"method": "specache_1bit_eom", "length": 1024, "depth": i / 4, "correct": ok}
                for i, ok in enumerate((True, False, True, True))})
  _write(tmp_path / "niah.json", cells)
  rows, _ = speculation.table(*(tmp_path / n for n in ("hit.json", "niah.json", "ruler.json", "steps.json",
                                                       "ppl.json")))
  eom = {r["label"]: r for r in rows}["specache_1bit_eom"]
  assert eom["niah"] == (3, 4) and eom["niah_vs_full"] == pytest.approx(2 / 3) and "niah_partial" not in eom


def test_missing_stores_give_no_rows(tmp_path):
  rows, md = speculation.table(*(tmp_path / n for n in ("a.json", "b.json", "c.json", "d.json", "e.json")))
  assert rows == [] and md.startswith("| SpeCache 1-bit |")


def test_steps_from_several_runs_are_each_taken_against_their_own_runs_faithful_step(tmp_path):
  """A label takes its first run's step and that run's faithful step as its base; the runs are named under the
  table; runs at different contexts or batches do not share the column."""
  hit, niah, ruler, steps, ppl = _stores(tmp_path)
  later = tmp_path / "steps2.json"
  later.write_text(json.dumps({"cells": [{"context": 4096, "batch": 1, "methods": {
      "specache_1bit_offload": {"step_s": 0.08}, "specache_1bit_eom_offload": {"step_s": 0.9},
      "specache_1bit_robust_offload": {"step_s": 0.12}}}]}))
  rows, md = speculation.table(hit, niah, ruler, [steps, later], ppl)
  by = {r["label"]: r for r in rows}
  assert by["specache_1bit_eom"]["step_vs_faithful"] == pytest.approx(1.25)       # the first run's, not 0.9 / 0.08
  assert by["specache_1bit_robust"]["step_ms"] == pytest.approx(120.0)
  assert by["specache_1bit_robust"]["step_vs_faithful"] == pytest.approx(1.5)      # against its own run's 0.08
  assert f"`{later}`: specache_1bit_robust" in md and "Offloaded steps from several runs" in md
  _, md_one = speculation.table(hit, niah, ruler, steps, ppl)
  assert "several runs" not in md_one
  later.write_text(json.dumps({"cells": [{"context": 8192, "batch": 1, "methods": {
      "specache_1bit_offload": {"step_s": 0.08}}}]}))
  with pytest.raises(ValueError, match=r"several \(context, batch\) cells \[\(4096, 1\), \(8192, 1\)\]"):
    speculation.table(hit, niah, ruler, [steps, later], ppl)
