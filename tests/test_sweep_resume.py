"""Result stores that survive faults: a sweep killed with SIGKILL at a random point resumes to the uninterrupted
run's results, and a truncated or bit-flipped result file is detected and recomputed, never read."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from configs import niah as niah_cfg
from experiments.lib import models, niah
from experiments.lib.store import CorruptResultWarning, ResultStore, fingerprint

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMING = ("batch_seconds", "run_id")        # what differs between two runs of the same cell


@pytest.fixture(scope="module")
def tiny():
  return models.load("tiny-random")


def _cfg(out, **overrides):
  c = niah_cfg.get_config("test")
  c.output_dir = str(out)
  for k, v in overrides.items():
    c[k] = v
  return c


def _cells(path) -> dict:
  return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["cells"]


def _without_timing(cells: dict) -> dict:
  return {c: {k: v for k, v in rec.items() if k not in TIMING} for c, rec in cells.items()}


def _store_with_records(path, n=6) -> dict:
  store = ResultStore(path, meta={"experiment": "unit"})
  rs = np.random.RandomState(0)
  recs = {f"m{i % 2}/len={100 + i}": {"answer": "".join(rs.choice(list("abcdefgh xyz"), 40)), "score": i / 7,
                                      "correct": bool(i % 3), "tokens": [int(t) for t in rs.randint(0, 99, 5)]}
          for i in range(n)}
  store.put_many(recs, fingerprint("unit"))
  return dict(store.cells)


# ---------------------------------------------------------------------------------------- damaged files
def test_a_truncated_result_file_is_set_aside_with_a_warning_and_nothing_is_read(tmp_path):
  path = tmp_path / "results.json"
  _store_with_records(path)
  whole = path.read_bytes()
  rs = np.random.RandomState(1)
  for cut in [len(whole) // 2, 1, len(whole) - 3] + list(rs.randint(1, len(whole) - 2, size=20)):
    path.write_bytes(whole[:cut])
    with pytest.warns(CorruptResultWarning, match=rf"result file {path} is damaged .*moved to "
                                                  r"results.json(\.\d+)?\.corrupt, every cell is recomputed"):
      store = ResultStore(path)
    assert store.cells == {} and not path.exists()
  assert len(list(tmp_path.glob("results.json*.corrupt"))) == 23               # each kept, none overwritten
  assert (tmp_path / "results.json.corrupt").read_bytes() == whole[:len(whole) // 2]


def test_a_flipped_bit_never_yields_a_changed_record(tmp_path):
  """Any single bit flip, anywhere in the file: each record read back is exactly one that was written under
  the same id (the others are recomputed); a flip inside a record drops that record, with a warning."""
  path = tmp_path / "results.json"
  written = _store_with_records(path)
  whole = path.read_bytes()
  rs = np.random.RandomState(2)
  dropped_one = 0
  for pos, bit in zip(rs.randint(0, len(whole), size=300), rs.randint(0, 8, size=300)):
    flipped = bytearray(whole)
    flipped[pos] ^= 1 << bit
    path.write_bytes(bytes(flipped))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      cells = ResultStore(path).cells
    assert all(written.get(c) == rec for c, rec in cells.items()), (pos, bit)
    if len(cells) < len(written):
      assert any(issubclass(w.category, CorruptResultWarning) and str(path) in str(w.message) for w in caught)
    if 0 < len(cells) < len(written):
      dropped_one += 1
      assert _cells(path) == cells                        # rewritten without the bad record
  assert dropped_one > 20                                 # many flips hit one record only, in valid JSON


def test_a_bit_flip_inside_one_answer_recomputes_that_cell_only(tmp_path):
  path = tmp_path / "results.json"
  written = _store_with_records(path)
  text = path.read_text(encoding="utf-8")
  at = text.index('"answer": "', text.index('"m1/len=103"')) + len('"answer": "') + 5
  path.write_bytes(text[:at].encode() + bytes([ord(text[at]) ^ 0x02]) + text[at + 1:].encode())
  with pytest.warns(CorruptResultWarning, match=r"1 record\(s\) do not match their checksums \(m1/len=103\); "
                                                r"they are recomputed \(the file as found is kept as "
                                                r"results.json.corrupt\)"):
    store = ResultStore(path)
  assert set(store.cells) == set(written) - {"m1/len=103"}
  assert not store.done("m1/len=103", fingerprint("unit")) and store.done("m0/len=100", fingerprint("unit"))
  assert (tmp_path / "results.json.corrupt").read_text(encoding="utf-8") != text
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert ResultStore(path).cells == store.cells         # the rewritten file is clean


def test_a_file_without_checksums_is_read_as_written(tmp_path):
  """Files written before checksums existed (no "checksums" mapping) load unchanged, without a warning."""
  path = tmp_path / "results.json"
  cells = {"a": {"answer": "x", "fingerprint": "f"}}
  path.write_text(json.dumps({"meta": {}, "cells": cells}))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert ResultStore(path).cells == cells


def test_a_killed_writers_temporary_is_removed_and_a_live_or_remote_ones_kept(tmp_path):
  """atomic_write_text's temporaries name their host and pid: opening the store removes those of dead processes
  of this host (killed mid-write), never a live writer's or another host's."""
  path = tmp_path / "results.json"
  written = _store_with_records(path)
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                        check=True, timeout=60)
  host = socket.gethostname()
  dead, live, remote = (tmp_path / f".results.json.{h}.{pid}.abc_123.tmp" for h, pid in
                        ((host, int(gone.stdout)), (host, os.getpid()), (host + "-other", int(gone.stdout))))
  for tmp in (dead, live, remote):
    tmp.write_text('{"cells": {"half')
  assert ResultStore(path).cells == written
  assert not dead.exists() and live.exists() and remote.exists()


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
  """The uninterrupted :test sweep (its result file's cells)."""
  out = tmp_path_factory.mktemp("straight")
  niah.run(_cfg(out), model=tiny, log=lambda *_: None)
  return _cells(out / "results.json")


def test_niah_recomputes_a_truncated_store_to_the_uninterrupted_results(tiny, straight, tmp_path):
  results = tmp_path / "results.json"
  niah.run(_cfg(tmp_path), model=tiny, log=lambda *_: None)
  text = results.read_bytes()
  results.write_bytes(text[:len(text) * 2 // 3])
  with pytest.warns(CorruptResultWarning, match="is damaged"):
    again = niah.run(_cfg(tmp_path), model=tiny, log=lambda *_: None)
  assert again.computed == len(straight) and again.skipped == 0
  assert _without_timing(_cells(results)) == _without_timing(straight)
  assert (tmp_path / "results.json.corrupt").read_bytes() == text[:len(text) * 2 // 3]


def test_niah_recomputes_a_bit_flipped_cell_only(tiny, straight, tmp_path):
  results = tmp_path / "results.json"
  niah.run(_cfg(tmp_path), model=tiny, log=lambda *_: None)
  first = _cells(results)
  cell = niah.cell_id("kivi_1bit", 336, 0.75)
  text = results.read_bytes()
  at = text.index(b'"depth_used": ', text.index(f'"{cell}"'.encode())) + len(b'"depth_used": ')
  results.write_bytes(text[:at] + bytes([text[at] ^ 0x01]) + text[at + 1:])     # 0.7.. -> 1.7..: valid JSON
  with pytest.warns(CorruptResultWarning, match=rf"1 record\(s\) do not match their checksums \({cell}\)"):
    again = niah.run(_cfg(tmp_path), model=tiny, log=lambda *_: None)
  assert again.computed == 1 and again.skipped == len(straight) - 1
  after = _cells(results)
  assert after[cell]["run_id"] != first[cell]["run_id"]
  assert _without_timing(after) == _without_timing(straight)


# ------------------------------------------------------------------------------------ killed and resumed
def _launch(out, stdout=subprocess.DEVNULL) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "experiments.niah", "--config=configs/niah.py:test",
                           f"--config.output_dir={out}"], cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE,
                          env=dict(os.environ))


def _cell_count(path: pathlib.Path) -> int:
  try:
    return len(_cells(path))
  except (OSError, ValueError):
    return 0


@pytest.mark.parametrize("seed", [45, 46])
def test_niah_killed_at_a_random_cell_resumes_to_exactly_the_uninterrupted_results(straight, seed, tmp_path):
  """One process: the :test sweep as a subprocess, SIGKILLed once a seeded random number of cells is stored
  plus a random delay (the kill can land mid-batch or mid-write), then rerun to completion by a second
  subprocess: the store equals an uninterrupted run's cell by cell (timing aside); the cells stored before the
  kill are kept, not recomputed; every other cell is computed once, by the rerun."""
  total = len(straight)
  rng = np.random.default_rng(seed)
  k, delay = int(rng.integers(1, total - 4)), float(rng.uniform(0.0, 0.2))
  out = tmp_path / "killed"
  results = out / "results.json"
  proc = _launch(out)
  deadline = time.monotonic() + 240
  try:
    seen_mtime = None
    while proc.poll() is None and time.monotonic() < deadline:
      mtime = results.stat().st_mtime_ns if results.exists() else None
      if mtime != seen_mtime and _cell_count(results) >= k:
        break
      seen_mtime = mtime
      time.sleep(0.002)
    time.sleep(delay)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-3000:]
  before = _cells(results)                                # a complete file, never half-written
  assert k <= len(before) < total, (k, len(before))
  rerun = _launch(out, stdout=subprocess.PIPE)
  printed, err = rerun.communicate(timeout=240)
  assert rerun.returncode == 0, err.decode()[-3000:]
  after = _cells(results)
  assert _without_timing(after) == _without_timing(straight)   # nothing lost, nothing changed
  assert all(after[c]["run_id"] == rec["run_id"] for c, rec in before.items())   # kept, not recomputed
  rerun_ids = {rec["run_id"] for c, rec in after.items() if c not in before}
  assert len(rerun_ids) == 1 and rerun_ids.isdisjoint({rec["run_id"] for rec in before.values()})
  assert f"{total - len(before)} cell(s) computed, {len(before)} reused" in printed.decode()
