"""Two processes of JAX's multi-process runtime (loopback, 2 CPU devices each, gloo collectives) generating on one
(data=2, model=2) mesh whose two axes both cross processes: every method, offloaded SpeCache included, gives the
one-process tokens and both processes exit cleanly; when one process raises, the other stops with an error
naming it, within the bound, and neither aborts."""
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import specache_jax as sj
from tests.multiprocess_cases import METHODS, model_and_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND_S = 300                  # the whole launch (2 processes compiling on a loaded 2-core machine)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(names: str, *extra: str):
  """Both worker processes -> [(returncode, stdout, stderr)]."""
  return _run_processes(lambda port, i: ["tests.multiprocess_worker", str(port), "2", str(i), names, *extra])


def _run_processes(args, env_extra=()):
  """`python -m <args(port, i)>` for i = 0, 1, to the end (killed past BOUND_S) -> [(returncode, stdout,
  stderr)]."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_backend_optimization_level=0")     # not conftest's 8 forced devices
  env.update(env_extra)
  port, t0 = _free_port(), time.monotonic()
  procs = [subprocess.Popen([sys.executable, "-m", *args(port, i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True) for i in range(2)]
  results = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=max(1.0, BOUND_S - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
      for q in procs:
        if q.poll() is None:
          os.killpg(q.pid, signal.SIGKILL)
      out, err = p.communicate()
      pytest.fail(f"the processes ran past {BOUND_S} s:\n{err[-3000:]}")
    results.append((p.returncode, out, err))
  return results


@functools.lru_cache(maxsize=None)
def _one_process(name: str) -> list:
  mdl, prompts = model_and_prompts()
  method, settings = METHODS[name]
  return np.asarray(sj.generate(mdl, prompts, max_new_tokens=6, stop_tokens=(),
                                cache=sj.cache_config(method, **settings)).tokens).tolist()


def test_two_processes_give_the_one_process_tokens_and_exit_cleanly():
  r0, r1 = _launch(",".join(METHODS))
  for i, (code, _, err) in enumerate((r0, r1)):
    assert code == 0, f"process {i} exited with {code}:\n{err[-3000:]}"
  lines = dict(line.split(" ", 1) for line in r0[1].splitlines() if line.startswith(("LAYOUT", "STORE")))
  assert json.loads(lines["LAYOUT"]) == [[0, 1], [1, 0]]      # data and model axes both cross processes
  held, whole = map(int, lines["STORE"].split())
  assert held * 2 == whole                                      # a host store holds its process's half
  got = dict(line.split(" ", 2)[1:] for line in r0[1].splitlines() if line.startswith("TOKENS"))
  assert sorted(got) == sorted(METHODS)
  for name in METHODS:
    assert json.loads(got[name]) == _one_process(name), name
  assert got["specache_offload"] == got["specache"]


@pytest.mark.parametrize("failing", [1, 0])
def test_a_failing_process_stops_the_other_with_its_error(failing):
  results = _launch("full", f"--fail={failing}")
  other = 1 - failing
  assert results[failing][0] == 1 and "RuntimeError: fails on purpose" in results[failing][2]
  code, _, err = results[other]
  assert code == 1, f"process {other} exited with {code} (-6: aborted):\n{err[-3000:]}"
  assert f"stopping: process {failing} failed: RuntimeError: fails on purpose" in err
  assert "Terminating process" not in err + results[failing][2]        # neither was aborted by JAX


def test_the_niah_sweep_with_distributed_writes_the_one_process_results(tmp_path):
  """experiments.niah :test with --distributed over 2 processes on a (2, 2) mesh: process 0 writes the result
  file, the same cells as one process writes (timing aside); process 1 neither writes nor prints the table."""
  from configs import niah as niah_cfg
  from experiments.lib import models, niah
  one, two = tmp_path / "one", tmp_path / "two"
  cfg = niah_cfg.get_config("test")
  cfg.output_dir = str(one)
  niah.run(cfg, model=models.load("tiny-random"), log=lambda *_: None)
  results = _run_processes(lambda port, i: [
      "experiments.niah", "--config=configs/niah.py:test", f"--config.output_dir={two}", "--mesh=2,2",
      "--distributed", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
      env_extra={"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2"})
  for i, (code, _, err) in enumerate(results):
    assert code == 0, f"process {i} exited with {code}:\n{err[-3000:]}"
  assert "written to" in results[0][1] and "written to" not in results[1][1]
  cells = lambda out: {c: {k: v for k, v in rec.items() if k not in ("batch_seconds", "run_id")}
                       for c, rec in json.loads((out / "results.json").read_text(encoding="utf-8"))["cells"].items()}
  assert cells(two) == cells(one)
  assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())


def test_bad_process_settings_are_refused_before_jax_starts():
  from specache_jax import multiprocess
  with pytest.raises(ValueError, match=r"process_id=2 must be < num_processes=2"):
    multiprocess.initialize("127.0.0.1:1", num_processes=2, process_id=2)
  with pytest.raises(ValueError, match=r"num_processes=-1 must be an integer >= 0"):
    multiprocess.initialize("127.0.0.1:1", num_processes=-1, process_id=0)
  out = subprocess.run([sys.executable, "-m", "experiments.niah", "--config=configs/niah.py:test", "--process_id=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 1 and "--process_id need(s) --distributed" in out.stderr, out.stderr[-2000:]
