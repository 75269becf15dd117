"""Shared output helpers: markdown tables, result-file headers, progress bars, matplotlib setup."""
from __future__ import annotations

import functools
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Iterable, Sequence

import jax


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
  """A markdown table; `align` has one char per column ('l' or 'r'), default first left, rest right."""
  headers = [str(h) for h in headers]
  align = align or "l" + "r" * (len(headers) - 1)
  if len(align) != len(headers):
    raise ValueError(f"align={align!r} must have one character per column ({len(headers)} columns)")
  lines = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
  for row in rows:
    cells = [str(c) for c in row]
    if len(cells) != len(headers):
      raise ValueError(f"row {cells} has {len(cells)} cells, the table has {len(headers)} columns")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE_PATHS = ("specache_jax", "experiments", "configs", "tools")   # what a result depends on (not results/)


@functools.lru_cache(maxsize=None)
def code_commit() -> str:
  """The commit this checkout's code is at (`git rev-parse --short HEAD`), with ' + uncommitted changes' when a
  tracked file under CODE_PATHS differs from it; 'unknown' outside a git checkout."""
  def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
  try:
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
      return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return "unknown"
  return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def header(title: str, command: str, notes: Sequence[str] = ()) -> str:
  """Title, the command that reproduces the file, the machine and the commit, and free-form notes."""
  devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
  lines = [f"# {title}", "", "Reproduce (from the repository root):", "", "```bash", command, "```", "",
           f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, "
           f"{jax.device_count()} × {devices} "
           f"(jax {jax.__version__}, Python {sys.version.split()[0]}); written {time.strftime('%Y-%m-%d %H:%M')} "
           f"at commit {code_commit()}."]
  if notes:
    lines.append("")
    lines.extend(notes)
  return "\n".join(lines) + "\n"


def progress(iterable, total: int | None = None, desc: str = ""):
  """A tqdm bar on stderr (plain iteration when tqdm is not installed)."""
  try:
    from tqdm.auto import tqdm
  except ImportError:  # pragma: no cover - tqdm ships with the requirements
    return iterable
  return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)


def pyplot():
  """matplotlib.pyplot on the non-interactive Agg backend (no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def mib(n_bytes: float) -> str:
  return f"{n_bytes / 2 ** 20:.2f}"


def _parse_list(text, what: str, cast, kind: str) -> list:
  items = text.split(",") if isinstance(text, str) else list(text)
  try:
    out = [cast(str(x).strip()) for x in items if str(x).strip()]
  except ValueError:
    raise ValueError(f"{what}={text!r} must be a comma-separated list of {kind}") from None
  if not out:
    raise ValueError(f"{what}={text!r} is empty")
  return out


def parse_int_list(text: str | Sequence[int], what: str) -> list[int]:
  """"1024,2048" (a CLI-friendly string) or a sequence -> ints."""
  return _parse_list(text, what, int, "integers")


def parse_float_list(text: str | Sequence[float], what: str) -> list[float]:
  return _parse_list(text, what, float, "numbers")
