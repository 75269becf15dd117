"""The device check (experiments/gpu_check.sh): its dry run at tiny sizes on this CPU, as CI runs it; a stage
stopped by its deadline, SIGINT or a stuck main thread still leaves its JSON; a failing check does not hide the
next; the sizes chosen for an H100 and an H200; the launcher's imports.

What the dry run checks is the script itself (stages found, time limits, one JSON per stage, checks that pass);
the numbers come from the lent device. The stages' limits are the device's, stretched 4x in a dry run (a test here
must not depend on how busy the CPU is)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from experiments.lib.bench import gpu_check
from experiments.lib.bench.check_record import EXIT_FAILED, EXIT_INTERRUPTED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30


def test_sizing_h100_vs_h200():
  h100 = gpu_check.device_sizing("NVIDIA H100 80GB HBM3", 81559 * 2 ** 20)      # nvidia-smi's memory.total
  h200 = gpu_check.device_sizing("NVIDIA H200", 143771 * 2 ** 20)
  assert (h100.peak_bytes_per_s, h200.peak_bytes_per_s) == (3.35e12, 4.8e12)
  for s in (h100, h200):                  # the paper's 48 GB, never above it
    assert 47 * GIB < s.memory_fraction * s.memory_bytes <= 48 * GIB, s
    assert s.model == "random:llama3-8b"
  assert h100.memory_fraction > 0.55 and h200.memory_fraction < 0.35
  assert gpu_check.device_sizing("NVIDIA H100 PCIe", 80 * GIB).peak_bytes_per_s == 2.0e12


def test_sizing_unknown_small_and_tpu():
  odd = gpu_check.device_sizing("Some Future GPU", 24 * GIB)
  assert odd.peak_bytes_per_s is None                       # the kernels stage uses the measured copy instead
  assert odd.memory_fraction is None and odd.model == "random:llama3.2-1b"     # under 48 GB: no cap
  tpu = gpu_check.device_sizing("TPU v5 lite", 16 * GIB, "tpu")
  assert tpu.peak_bytes_per_s == 8.19e11 and tpu.memory_fraction is None and tpu.model == "random:llama3.2-1b"
  assert gpu_check.device_sizing("TPU v4", 96 * GIB, "tpu").memory_fraction is None      # no such knob on a TPU
  with pytest.raises(ValueError, match="platform='rocm'"):
    gpu_check.device_sizing("x", None, "rocm")


def _stage_script(body: str, deadline_s: float) -> str:
  """A Python program running one StageRecord stage with checks defined by `body` (a function `run(rec)`)."""
  return "\n".join(["import sys, time, signal", "from experiments.lib.bench.check_record import StageRecord",
                    textwrap.dedent(body),
                    f"rec = StageRecord(sys.argv[1], 'demo', dict(dry_run=True), {deadline_s})",
                    "sys.exit(rec.run(run))"])


def _run_stage(tmp_path, body: str, deadline_s: float, after_start=None):
  proc = subprocess.Popen([sys.executable, "-c", _stage_script(body, deadline_s), str(tmp_path)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  if after_start:
    after_start(proc)
  out, err = proc.communicate(timeout=120)
  return proc.returncode, json.loads((tmp_path / "demo.json").read_text()), out + err


def test_failed_check_is_recorded_and_the_next_runs(tmp_path):
  body = """
      def run(rec):
        rec.check("first", lambda: 1 / 0)
        rec.check("second", lambda: {"value": 3})
        rec.check("third", lambda: False)
      """
  rc, rep, log = _run_stage(tmp_path, body, 0)
  assert rc == EXIT_FAILED, log
  assert rep["status"] == "failed checks" and rep["failed"] == ["first", "third"]
  assert "ZeroDivisionError" in rep["checks"]["first"]["error"] and "<lambda>" in rep["checks"]["first"]["traceback"]
  assert rep["checks"]["second"] == dict(ok=True, value={"value": 3}, seconds=rep["checks"]["second"]["seconds"])
  assert rep["checks"]["third"]["ok"] is False


def test_deadline_inside_python_writes_what_finished(tmp_path):
  body = """
      def run(rec):
        rec.check("quick", lambda: True)
        rec.check("slow", time.sleep, 60)
        rec.check("never", lambda: True)
      """
  t0 = time.monotonic()
  rc, rep, log = _run_stage(tmp_path, body, 1.0)
  assert time.monotonic() - t0 < 30
  assert rc == EXIT_INTERRUPTED, log
  assert rep["status"] == "deadline" and rep["checks"]["quick"]["ok"] is True
  assert rep["checks"]["slow"]["error"] == "interrupted: deadline" and "never" not in rep["checks"]


def test_a_deadline_whose_exception_was_swallowed_still_stops_the_stage(tmp_path):
  """Python ignores an exception raised in a gc callback or a __del__ (JAX's `_xla_gc_callback` swallowed the
  alarm's Deadline once, and the stage ran on to exit 0): the passed deadline still stops the stage."""
  body = """
      def swallowing():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
          try:
            time.sleep(0.05)
          except BaseException:                        # what a gc callback does with the alarm's exception
            pass
        return True

      def run(rec):
        rec.check("quick", lambda: True)
        rec.check("swallows", swallowing)
        rec.check("never", lambda: True)
      """
  rc, rep, log = _run_stage(tmp_path, body, 0.5)
  assert rc == EXIT_INTERRUPTED, log
  assert rep["status"] == "deadline" and rep["checks"]["quick"]["ok"] is True
  assert rep["checks"]["swallows"]["error"] == "interrupted: deadline" and "never" not in rep["checks"]
  body_last = """
      def run(rec):
        rec.check("quick", lambda: True)
        try:
          time.sleep(2.0)                                # outside any check, the exception swallowed
        except BaseException:
          pass
      """
  rc, rep, log = _run_stage(tmp_path, body_last, 0.5)
  assert rc == EXIT_INTERRUPTED and rep["status"] == "deadline", log


def test_sigint_mid_stage_still_writes_the_json(tmp_path):
  body = """
      def run(rec):
        rec.check("quick", lambda: True)
        rec.check("waiting", lambda: (print("waiting", flush=True), time.sleep(60)))
      """

  def interrupt(proc):
    assert proc.stdout.readline().strip() == "waiting"          # the first check is recorded by now
    proc.send_signal(signal.SIGINT)                             # what the shell's `timeout --signal=INT` sends

  rc, rep, log = _run_stage(tmp_path, body, 0, after_start=interrupt)
  assert rc == EXIT_INTERRUPTED, log
  assert rep["status"] == "killed (SIGINT)" and rep["checks"]["quick"]["ok"] is True
  assert rep["checks"]["waiting"]["error"] == "interrupted: killed (SIGINT)"


def test_watchdog_writes_the_json_when_the_main_thread_never_sees_the_signal(tmp_path):
  # signals blocked in the main thread stand for a main thread busy in native code (a compile, a device wait)
  body = """
      def stuck():
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM, signal.SIGINT, signal.SIGTERM])
        time.sleep(60)
      def run(rec):
        rec.check("quick", lambda: True)
        rec.check("stuck", stuck)
      """
  t0 = time.monotonic()
  rc, rep, log = _run_stage(tmp_path, body, 1.0)
  assert time.monotonic() - t0 < 40
  assert rc == EXIT_INTERRUPTED, log
  assert rep["status"] == "deadline" and "watchdog" in rep["error"] and rep["checks"]["quick"]["ok"] is True
  assert rep["checks"]["stuck"]["error"].startswith("interrupted: deadline")


def test_launcher_imports_only_jax_numpy_absl():
  code = ("import sys; import jax, numpy, absl.app, absl.flags; before = set(sys.modules); "
          "import experiments.gpu_check; "
          "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert json.loads(out.strip().replace("'", '"')) == ["experiments"], out


def test_gpu_check_dry_run_writes_every_stage(tmp_path):
  env = dict(os.environ, PYTHON=sys.executable)
  proc = subprocess.run(["bash", "experiments/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=3600)
  log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else proc.stdout
  assert proc.returncode == 0, log[-3000:]
  reps = {stage: json.loads((tmp_path / f"{stage}.json").read_text()) for stage in gpu_check.STAGES}
  for stage, rep in reps.items():
    assert rep["status"] == "ok" and rep["dry_run"] is True, (stage, rep.get("error"), rep.get("failed"))
    assert rep["checks"]["device"]["ok"] and 0 < rep["deadline_s"], stage
  smoke = reps["smoke"]["checks"]
  assert {"specache_k_ge_n_equals_full", "offload_numpy_equals_simulated", "pallas_interpret_equals_jnp"} <= set(smoke)
  collect = reps["kernel_tests"]["checks"]["collect"]["value"]
  assert collect["compiled"] > 0 and collect["ok"]           # compiled classes collected, no Interpret one
  assert all(reps["kernels"]["checks"][f"{op}_small_{b}bit"]["ok"] for op in ("quant_scores", "mixed")
             for b in (1, 2))
  overlap = reps["overlap"]["checks"]
  assert all("stores" in c["value"] for name, c in overlap.items() if name.startswith("cell_")), overlap
  assert os.path.isdir(overlap["trace"]["value"])
  assert {"full", "specache_1bit_offload"} <= {k for k, v in reps["throughput"]["checks"].items()
                                               if isinstance(v.get("value"), dict) and "step_s" in v["value"]}
  assert all(f"{stage} rc=0" in (tmp_path / "summary.txt").read_text() for stage in gpu_check.STAGES)


def test_tpu_kernels_stage_checks_the_mosaic_kernels(tmp_path):
  """--platform=tpu checks pallas_kernels/tpu/ (compiled on a TPU; here in TPU interpret mode) vs the references."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--stage=kernels", "--platform=tpu",
                         f"--out={tmp_path}", "--dry_run", "--deadline_s=600"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=700)
  rep = json.loads((tmp_path / "kernels.json").read_text())
  assert proc.returncode == 0 and rep["status"] == "ok", (proc.stderr[-2000:], rep)
  assert rep["platform"] == "tpu" and rep["checks"]["device"]["value"]["platform"] == "tpu"
  assert {f"{op}_small_{b}bit" for op in ("quant_scores", "mixed") for b in (1, 2)} <= set(rep["checks"])


def test_real_stage_past_its_deadline_keeps_the_checks_it_finished(tmp_path):
  """The smoke stage with a deadline far below its run time on this CPU: stopped, its JSON says so."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--stage=smoke", f"--out={tmp_path}",
                         "--dry_run", "--deadline_s=8"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  rep = json.loads((tmp_path / "smoke.json").read_text())
  assert proc.returncode == EXIT_INTERRUPTED, (proc.stderr[-2000:], rep)
  assert rep["status"] == "deadline" and rep["checks"]["device"]["ok"], rep
  assert any(c.get("error", "").startswith("interrupted: deadline") for c in rep["checks"].values()), rep["checks"]
  assert "copy_bandwidth" not in rep["checks"] and time.monotonic() - t0 < 120
