"""A two-process sweep (`experiments.niah --distributed`, loopback, 2 CPU devices each, one (2, 2) mesh) with one
process SIGKILLed at a random cell: the other stops within a bound, with an error naming the lost process, and
relaunching both with the same output folder gives exactly the uninterrupted run's results (nothing lost,
nothing computed twice, the cells stored before the kill kept)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from configs import niah as niah_cfg
from experiments.lib import models, niah
from experiments.lib.launch import COPY_PREFIX

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMING = ("batch_seconds", "run_id")        # what differs between two runs of the same cell
RUN_BOUND_S = 240                           # a launch of both processes, to its end (a loaded 2-core machine)
SURVIVOR_BOUND_S = 60                       # the survivor's exit after the kill (JAX's heartbeat limit is 30 s)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cells(path) -> dict:
  return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["cells"]


def _without_timing(cells: dict) -> dict:
  return {c: {k: v for k, v in rec.items() if k not in TIMING} for c, rec in cells.items()}


def _cell_count(path: pathlib.Path) -> int:
  try:
    return len(_cells(path))
  except (OSError, ValueError):
    return 0


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted :test sweep, one process (test_multiprocess: two write the same cells)."""
  cfg = niah_cfg.get_config("test")
  cfg.output_dir = str(tmp_path_factory.mktemp("straight"))
  niah.run(cfg, model=models.load("tiny-random"), log=lambda *_: None)
  return _cells(pathlib.Path(cfg.output_dir) / "results.json")


class _Launch:
  """Both processes of the :test sweep on a fresh port, their output in logs/<name>.<i>.{out,err}."""

  def __init__(self, out: pathlib.Path, logs: pathlib.Path, name: str):
    self.port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2")
    self.files = [(logs / f"{name}.{i}.out", logs / f"{name}.{i}.err") for i in range(2)]
    self.procs = []
    for i, (o, e) in enumerate(self.files):
      with open(o, "w") as fo, open(e, "w") as fe:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "experiments.niah", "--config=configs/niah.py:test", f"--config.output_dir={out}",
             "--mesh=2,2", "--distributed", f"--coordinator_address=127.0.0.1:{self.port}", "--num_processes=2",
             f"--process_id={i}"], cwd=ROOT, env=env, stdout=fo, stderr=fe, start_new_session=True))

  def out(self, i: int) -> str:
    return self.files[i][0].read_text(encoding="utf-8", errors="replace")

  def err(self, i: int) -> str:
    return self.files[i][1].read_text(encoding="utf-8", errors="replace")

  def wait(self, i: int, timeout: float) -> int:
    try:
      return self.procs[i].wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
      self.kill()
      pytest.fail(f"process {i} ran past its bound ({timeout:.0f} s left):\n{self.err(i)[-3000:]}")

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.parametrize("victim,seed", [(1, 45), (0, 46)])
def test_a_process_killed_at_a_random_cell_stops_the_other_and_a_relaunch_resumes_exactly(
    straight, victim, seed, tmp_path):
  """SIGKILL process `victim` once a seeded random number of cells is stored plus a random delay (the kill
  lands mid-batch, mid-write or between cells); the survivor exits within SURVIVOR_BOUND_S naming the lost
  process: process 1 lost -> `stopping: process 1 is gone` (exit 1); process 0 lost -> our `stopping: process 0
  (the coordinator at ...) is gone` (exit 1) or JAX's abort naming the leader task, whichever comes first.
  Then both are relaunched: the store equals the uninterrupted run's, the cells stored before the kill are
  kept, every other cell is computed once (one run id: process 0's), and no temporary is left behind."""
  total = len(straight)
  rng = np.random.default_rng(seed)
  k, delay = int(rng.integers(1, total - 4)), float(rng.uniform(0.0, 3.0))
  out, logs = tmp_path / "out", tmp_path / "logs"
  logs.mkdir()
  results = out / "results.json"
  first = _Launch(out, logs, "first")
  try:
    deadline = time.monotonic() + RUN_BOUND_S
    while _cell_count(results) < k and time.monotonic() < deadline and all(p.poll() is None for p in first.procs):
      time.sleep(0.01)
    time.sleep(delay)
    assert all(p.poll() is None for p in first.procs), (first.err(0)[-2000:], first.err(1)[-2000:])
    first.procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    code = first.wait(1 - victim, SURVIVOR_BOUND_S)
    took = time.monotonic() - killed_at
  finally:
    first.kill()
  assert first.procs[victim].returncode == -signal.SIGKILL
  err = first.err(1 - victim)
  if victim == 1:
    assert code == 1, f"process 0 exited with {code}:\n{err[-3000:]}"
    assert "stopping: process 1 is gone (no sign of life for 1 s: killed, or its host unreachable)" in err, err[-3000:]
  else:
    ours = f"stopping: process 0 (the coordinator at 127.0.0.1:{first.port}) is gone (killed, or its host unreachable)"
    jaxs = "Either the leader task was preempted/died/restarted unexpectedly"
    assert (code, ours in err) == (1, True) or (code, jaxs in err) == (-signal.SIGABRT, True), (code, err[-3000:])
  assert took < SURVIVOR_BOUND_S
  before = _cells(results)                                  # a complete file, never half-written
  assert k <= len(before) < total, (k, len(before))

  again = _Launch(out, logs, "again")
  try:
    codes = [again.wait(i, RUN_BOUND_S) for i in range(2)]
  finally:
    again.kill()
  assert codes == [0, 0], (again.err(0)[-3000:], again.err(1)[-3000:])
  after = _cells(results)
  assert _without_timing(after) == _without_timing(straight)                       # nothing lost, nothing changed
  assert all(after[c]["run_id"] == rec["run_id"] for c, rec in before.items())     # kept, not recomputed
  rerun_ids = {rec["run_id"] for c, rec in after.items() if c not in before}
  assert len(rerun_ids) == 1 and rerun_ids.isdisjoint({rec["run_id"] for rec in before.values()})
  assert f"{total - len(before)} cell(s) computed, {len(before)} reused" in again.out(0)
  assert "written to" not in again.out(1)                                          # process 1 wrote nothing
  assert not list(out.glob(".*.tmp"))
  dead_copies = [p for p in pathlib.Path(tempfile.gettempdir()).glob(f"{COPY_PREFIX}*")
                 if any(p.name.startswith(f"{COPY_PREFIX}{q.pid}_") for q in first.procs)]
  assert not dead_copies                                    # the killed process's copy, removed by the relaunch
