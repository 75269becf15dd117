"""Resumable result files: cells written incrementally and atomically, finished cells skipped on restart.

A sweep is a set of cells (e.g. NIAH: method × context length × needle depth). `ResultStore` keeps them in one
JSON file `{"cells": {cell_id: record}}`; every `put` rewrites the file through a temporary file and
`os.replace`, so a run killed at any moment leaves either the previous or the new complete file. Each record
carries the fingerprint of the settings that produced it: a restarted run with different settings recomputes
the cell instead of reusing a stale answer.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import dataclasses
import tempfile
import time
import uuid
from typing import Any, Iterable, Mapping


@dataclasses.dataclass
class SweepResult:
  """What every experiment's `run` returns."""
  table: str                 # the markdown table the launcher prints
  records: dict              # the sweep's results: cell id -> record (ablations: label -> joined row;
                             # longbench: method -> task -> score)
  computed: int              # cells computed by this call
  skipped: int               # cells reused from the result file
  seconds: float


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
  """Write `text` to `path` via a temporary file in the same folder and `os.replace` (atomic on POSIX)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
  atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False, ensure_ascii=False) + "\n")


def fingerprint(*parts: Any) -> str:
  """A short stable hash of JSON-serializable settings (what makes a cell's answer what it is)."""
  blob = json.dumps(parts, sort_keys=True, default=repr).encode("utf-8")
  return hashlib.sha256(blob).hexdigest()[:16]


class ResultStore:
  """`{cell_id: record}` persisted in one JSON file; `run_id` marks the records this process computed."""

  def __init__(self, path: str | os.PathLike, meta: Mapping[str, Any] | None = None):
    self.path = pathlib.Path(path)
    self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    self.meta = dict(meta or {})
    self.cells: dict[str, dict] = {}
    self.computed = 0          # cells this process has put
    if self.path.exists():
      try:
        data = json.loads(self.path.read_text(encoding="utf-8"))
      except json.JSONDecodeError as e:
        raise ValueError(f"result file {self.path} is not valid JSON ({e.msg}); delete it to start over") from e
      if not isinstance(data, dict) or not isinstance(data.get("cells"), dict):
        raise ValueError(f"result file {self.path} has no 'cells' mapping; delete it to start over")
      self.cells = data["cells"]

  def done(self, cell_id: str, fp: str) -> bool:
    """Whether `cell_id` has a record computed with the same settings fingerprint."""
    rec = self.cells.get(cell_id)
    return rec is not None and rec.get("fingerprint") == fp

  def pending(self, cells: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (cell_id, fingerprint) pairs without a matching record."""
    return [(c, fp) for c, fp in cells if not self.done(c, fp)]

  def put_many(self, records: Mapping[str, dict], fp: str | Mapping[str, str]) -> None:
    """Add records (one atomic file write for all of them)."""
    for cell_id, rec in records.items():
      cell_fp = fp if isinstance(fp, str) else fp[cell_id]
      self.cells[cell_id] = dict(rec, fingerprint=cell_fp, run_id=self.run_id)
      self.computed += 1
    self.save()

  def get(self, cell_id: str) -> dict:
    return self.cells[cell_id]

  def save(self) -> None:
    atomic_write_json(self.path, {"meta": self.meta, "cells": self.cells})
