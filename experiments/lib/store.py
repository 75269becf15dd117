"""Resumable result files: cells written incrementally and atomically, finished cells skipped on restart.

A sweep is a set of cells (e.g. NIAH: method × context length × needle depth). `ResultStore` keeps them in one
JSON file `{"meta": ..., "cells": {cell_id: record}, "checksums": {cell_id: sha256 of the record}}`; every
`put` rewrites the file through a temporary file, fsync and `os.replace`, so a run killed at any moment (even
by SIGKILL) leaves either the previous or the new complete file. Each record carries the fingerprint of the
settings that produced it: a restarted run with different settings recomputes the cell instead of reusing a
stale answer. A writer killed mid-write leaves its temporary file (`.<name>.<host>.<pid>.*.tmp`, never read);
the next `ResultStore` on that file removes those of dead processes of this host.

A damaged file is never read as results: one that is not valid JSON (truncated, bytes flipped) is renamed
`<name>.corrupt` and the sweep starts over; a record whose checksum does not match (a flipped bit that
still parses) is dropped, to be recomputed, the file as found kept as `<name>.corrupt`. Each case warns
(`CorruptResultWarning`) naming the file. Files written before checksums existed are read as they are.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import dataclasses
import re
import socket
import tempfile
import time
import uuid
import warnings
from typing import Any, Iterable, Mapping


class CorruptResultWarning(UserWarning):
  """A result file (or some of its records) failed to parse or to match its checksum and is recomputed."""


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
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{socket.gethostname()}.{os.getpid()}.", suffix=".tmp",
                             dir=path.parent)
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
  _fsync_dir(path.parent)


def remove_dead_writers_temporaries(path: str | os.PathLike) -> list[pathlib.Path]:
  """Remove the temporary files `atomic_write_text(path, ...)` left in a process of this host that is gone
  (killed mid-write) -> those removed. A live writer's, or another host's, stay."""
  path = pathlib.Path(path)
  pattern = re.compile(rf"\.{re.escape(path.name)}\.(.+)\.(\d+)\.[^.]+\.tmp")
  removed = []
  for tmp in path.parent.glob(f".{path.name}.*.tmp"):
    m = pattern.fullmatch(tmp.name)
    if m is None or m[1] != socket.gethostname() or process_alive(int(m[2])):
      continue
    tmp.unlink(missing_ok=True)
    removed.append(tmp)
  return removed


def process_alive(pid: int) -> bool:
  """Whether process `pid` of this host exists."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:                   # another user's
    pass
  return True


def _fsync_dir(folder: pathlib.Path) -> None:
  """Make a rename in `folder` durable (POSIX; a no-op where folders cannot be opened)."""
  try:
    fd = os.open(folder, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
  atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False, ensure_ascii=False) + "\n")


def record_checksum(rec: Any) -> str:
  """sha256 of a record as the store serializes it (stable through a write and a read: int keys and tuples
  serialize as their JSON forms either way)."""
  return hashlib.sha256(json.dumps(rec, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def set_aside(path: pathlib.Path) -> pathlib.Path:
  """Rename `path` to `<name>.corrupt` (`<name>.<n>.corrupt` when taken) -> the new path."""
  target, n = path.with_name(path.name + ".corrupt"), 1
  while target.exists():
    n += 1
    target = path.with_name(f"{path.name}.{n}.corrupt")
  os.replace(path, target)
  return target


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
    remove_dead_writers_temporaries(self.path)
    if self.path.exists():
      self.cells = self._load()

  def _load(self) -> dict[str, dict]:
    """The file's records whose checksums match; a damaged file or record is set aside with a warning."""
    try:
      data = json.loads(self.path.read_bytes().decode("utf-8"))
      if not isinstance(data, dict) or not isinstance(data.get("cells"), dict):
        raise ValueError("no 'cells' mapping")
      sums = data.get("checksums")
      if sums is not None and not isinstance(sums, dict):
        raise ValueError("'checksums' is not a mapping")
    except ValueError as e:                 # JSONDecodeError and UnicodeDecodeError are ValueErrors
      aside = set_aside(self.path)
      warnings.warn(f"result file {self.path} is damaged ({type(e).__name__}: {e}); moved to {aside.name}, "
                    "every cell is recomputed", CorruptResultWarning, stacklevel=3)
      return {}
    cells = data["cells"]
    if sums is None:                        # written before checksums existed
      return cells
    bad = [c for c, rec in cells.items() if not isinstance(rec, dict) or sums.get(c) != record_checksum(rec)]
    if bad:
      aside = set_aside(self.path)
      cells = {c: rec for c, rec in cells.items() if c not in bad}
      atomic_write_json(self.path, {"meta": data.get("meta", {}), "cells": cells,
                                    "checksums": {c: sums[c] for c in cells}})
      shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
      warnings.warn(f"result file {self.path}: {len(bad)} record(s) do not match their checksums ({shown}); "
                    f"they are recomputed (the file as found is kept as {aside.name})", CorruptResultWarning,
                    stacklevel=3)
    return cells

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
    atomic_write_json(self.path, {"meta": self.meta, "cells": self.cells,
                                  "checksums": {c: record_checksum(rec) for c, rec in self.cells.items()}})
