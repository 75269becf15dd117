"""The documentation holds together: the results index is the script's output, and every relative link resolves."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _results_index():
  """tools/results_index.py as a module (tools/ is not a package: it runs from a checkout)."""
  if "results_index" not in sys.modules:
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "tools" / "results_index.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_index"] = module   # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
  return sys.modules["results_index"]


def _doc_pages() -> list[pathlib.Path]:
  return [ROOT / "README.md", ROOT / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_committed_results_index_is_the_scripts_output():
  committed = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
  assert committed == _results_index().render(ROOT), "results/README.md is stale: run python tools/results_index.py"


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
  text = page.read_text(encoding="utf-8")
  targets = [t for t in LINK_RE.findall(text) if not re.match(r"^[a-z]+:|^#", t)]
  assert targets or page.name != "README.md", f"{page} has no relative links: is the link pattern still right?"
  missing = [t for t in targets if not (page.parent / t.split("#", 1)[0]).exists()]
  assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_index_covers_every_result_file():
  index = _results_index()
  results = ROOT / "results"
  listed = {f for entry in index._group(results) for f in entry.files}
  on_disk = {p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file()} - {"README.md"}
  assert listed == on_disk


def test_index_reads_unknown_and_known_runs_alike(tmp_path):
  """A store the script knows gets its headline; a file of a kind it does not know still gets a row."""
  store = tmp_path / "results" / "needles"
  store.mkdir(parents=True)
  (store / "summary.md").write_text("# Needle in a Haystack\n\nReproduce:\n\n```bash\npython -m experiments.niah "
                                    "--config=configs/niah.py\n```\n\nMachine: written 2030-01-02 03:04.\n")
  cells = {f"{m}/len=1024_depth={d}": {"method": m, "correct": m == "full" or d == 0.5}
           for m in ("full", "specache_1bit") for d in (0.25, 0.5)}
  (store / "results.json").write_text(json.dumps({"meta": {"experiment": "niah", "command": "x"}, "cells": cells}))
  (store / "heatmap_full.png").write_bytes(b"")
  (tmp_path / "results" / "odd.json").write_text(json.dumps({"something": [1, 2]}))
  (tmp_path / "results" / "broken").mkdir()
  (tmp_path / "results" / "broken" / "results.json").write_text(json.dumps({"meta": {"experiment": "ruler"},
                                                                            "cells": {"a": {}}}))
  scores = tmp_path / "results" / "longbench"
  scores.mkdir()
  (scores / "results.json").write_text(json.dumps({"meta": {"experiment": "longbench"}, "cells": {"x/qasper": {}}}))
  text = _results_index().render(tmp_path)
  assert "[`needles`](needles/summary.md)**: Needle in a Haystack" in text
  assert "command: `python -m experiments.niah --config=configs/niah.py`" in text
  assert "recorded: 2030-01-02 03:04" in text
  assert "needles found: full 2/2, specache_1bit 1/2" in text and "1 figure" in text
  assert "[`odd`](odd.json)" in text and "command: not recorded in the file" in text
  assert "[`broken`](broken/results.json)" in text and "(no headline: the file's layout" in text
  assert "- **[`longbench`](longbench/results.json)**\n  - command: not recorded in the file\n" in text
