"""The GPU check's dry run: every stage of experiments/gpu_check.sh at tiny sizes on this CPU, as CI runs it.

What it checks is the script itself (stages found, time limits, one JSON per stage, checks that pass); the
numbers come from the lent GPU machine. The stages' limits are the GPU's, stretched 4x in a dry run (a test
here must not depend on how busy the CPU is)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_dry_run_writes_every_stage(tmp_path):
  env = dict(os.environ, PYTHON=sys.executable)
  proc = subprocess.run(["bash", "experiments/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1800)
  log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else proc.stdout
  assert proc.returncode == 0, log[-3000:]
  for stage in ("smoke", "kernels", "overlap", "throughput"):
    rep = json.loads((tmp_path / f"{stage}.json").read_text())
    assert rep["status"] == "ok" and rep["dry_run"] is True, (stage, rep.get("error"))
  smoke = json.loads((tmp_path / "smoke.json").read_text())
  assert smoke["checks"] and all(smoke["checks"].values()), smoke["checks"]
  overlap = json.loads((tmp_path / "overlap.json").read_text())
  assert all("stores" in c for c in overlap["cells"]), overlap["cells"]
  assert os.path.isdir(overlap["trace"])
  throughput = json.loads((tmp_path / "throughput.json").read_text())
  assert {"full", "specache_1bit_offload"} <= {k for k, v in throughput["methods"].items() if "step_s" in v}
  assert "kernel_tests rc=0" in (tmp_path / "summary.txt").read_text()
