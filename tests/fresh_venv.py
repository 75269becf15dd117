"""A fresh virtual environment holding only jax (as a Colab runtime does), for the install tests.

Installing the runtime dependencies into a new venv is most of these tests' time (about a minute on 2 idle cores,
from the machine's wheel mirror / pip's cache), so one venv is made per session and shared: test_notebook.py
installs the package into it from a copy of the checkout (the notebook's own install cell), test_packaging.py
then swaps in the built wheel (the runtime dependencies are already there, pip only checks them).
`jax_only()` hands out a venv that nothing has been installed into yet (a new one if the shared one was used).
A venv (~1.3 GB) is deleted when the test session exits.
"""
from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 1200    # a venv install on a busy 2-core machine: minutes, not seconds


def pins(name: str = "requirements.txt") -> dict[str, str]:
  """`name==version` lines of a requirements file -> {normalized name: version} (comments and -r skipped)."""
  out = {}
  for line in (ROOT / name).read_text(encoding="utf-8").splitlines():
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
      continue
    dist, sep, version = line.partition("==")
    if not sep:
      raise ValueError(f"{name}: {line!r} is not an exact pin (name==version)")
    out[normalize(dist)] = version.strip()
  return out


def normalize(dist: str) -> str:
  """PEP 503 name normalization: `ml_collections` and `ML-Collections` are the same distribution."""
  return "-".join(dist.replace("_", "-").replace(".", "-").lower().split("-"))


def clean_env(**extra: str) -> dict[str, str]:
  """The test process's environment without its venv, PYTHONPATH or forced device count; JAX on the CPU."""
  env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "XLA_FLAGS")}
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env


def run(cmd: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None,
        timeout: float = INSTALL_TIMEOUT_S) -> str:
  """Runs `cmd`, returns its stdout + stderr; AssertionError with the output when it fails."""
  proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited with {proc.returncode} in {cwd}:\n{proc.stdout}"
  return proc.stdout


class Venv:

  def __init__(self, path: pathlib.Path):
    self.path = path
    self.python = path / "bin" / "python"
    self.used = False       # something besides jax was installed

  def pip(self, *args: str, cwd: pathlib.Path | None = None) -> str:
    self.used = True
    return run([self.python, "-m", "pip", *args], cwd=cwd or self.path)

  def has(self, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([self.python, "-c", code], cwd=self.path, env=clean_env()).returncode == 0


_shared: list[Venv] = []


def _create(path: pathlib.Path) -> Venv:
  atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
  run([sys.executable, "-m", "venv", path], cwd=path.parent)     # based on the interpreter, not on this venv
  venv = Venv(path)
  jax_pins = pins()
  run([venv.python, "-m", "pip", "install", "--quiet", f"jax=={jax_pins['jax']}", f"jaxlib=={jax_pins['jaxlib']}"],
      cwd=path)
  return venv


def shared(tmp_path_factory) -> Venv:
  """The session's venv (made with jax only on first use; may hold whatever earlier tests installed)."""
  if not _shared:
    _shared.append(_create(tmp_path_factory.mktemp("fresh_venv") / "venv"))
  return _shared[0]


def jax_only(tmp_path_factory) -> Venv:
  """A venv with nothing but jax/jaxlib (and pip) installed: the shared one while unused, else a new one."""
  if _shared and _shared[0].used:
    _shared[0] = _create(tmp_path_factory.mktemp("fresh_venv") / "venv")
  return shared(tmp_path_factory)


def copy_checkout(dest: pathlib.Path) -> pathlib.Path:
  """The files of the working tree that git tracks or would track (no .venv, caches, runs/, build outputs)."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                          stdout=subprocess.PIPE, check=True).stdout.decode("utf-8").split("\0")
  for rel in filter(None, listed):
    src = ROOT / rel
    if src.is_file():          # listed but deleted in the working tree: skipped
      (dest / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dest / rel)
  return dest
