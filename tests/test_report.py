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
