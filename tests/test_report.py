"""Result-file headers name the commit the code ran at."""
import subprocess

from experiments.lib import report


def test_header_names_the_commit_of_this_checkout():
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=report.ROOT, capture_output=True,
                        text=True).stdout.strip()
  text = report.header("T", "python -m x")
  assert head and f"at commit {head}" in text
  line = next(line for line in text.splitlines() if line.startswith("Machine:"))
  assert line.endswith(f"at commit {report.code_commit()}.")


def test_a_benchmark_file_names_the_commit_it_ran_at(tmp_path, monkeypatch):
  """The config-file benchmark launchers (`bench.launch.run_benchmark`) record the commit in the JSON and the
  markdown's first lines, read before the run (HEAD may move while a long benchmark runs)."""
  import json

  import ml_collections

  from experiments.lib.bench import launch as bench_launch
  from experiments.lib.bench import report as bench_report

  config = ml_collections.ConfigDict(dict(model="random:tiny", dtype="", seed=0, out=str(tmp_path / "bench")))
  seen = []
  monkeypatch.setattr(report, "code_commit", lambda: seen.append("read") or "abc1234")
  monkeypatch.setattr(bench_launch.launch, "start_one_device", lambda name, argv: None)   # flags: the launcher's

  def runner(config, model, log):
    assert seen == ["read"]                           # read before the benchmark runs
    return {"meta": {"model": model.source, "seconds": 0.0}}

  markdown = lambda r: "\n".join(["# T", ""] + bench_report._machine(r["meta"]))
  bench_launch.run_benchmark("demo", config, runner, markdown, ["demo"])
  meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
  assert meta["commit"] == "abc1234" and meta["command"].startswith("python -m experiments.demo")
  assert "; commit: abc1234" in (tmp_path / "bench.md").read_text()
