"""Issue 14's ablation table of SpeCache 1-bit's robust-speculation variants, joined from the stores the hit-rate,
NIAH, RULER, offloaded-step and perplexity experiments wrote (`experiments/lib/speculation.py`; nothing is
recomputed).

  python -m experiments.speculation_table          # results/speculation/summary.md + table.json
"""
import pathlib
import sys

from absl import app, flags

from experiments.lib import speculation
from experiments.lib.store import atomic_write_json, atomic_write_text

_HITRATE = flags.DEFINE_string("hitrate", "results/speculation/hitrate/results.json", "experiments.hitrate store")
_NIAH = flags.DEFINE_string("niah", "results/speculation/niah/results.json", "experiments.niah store (the grid)")
_RULER = flags.DEFINE_string("ruler", "results/ruler_robust/results.json", "experiments.ruler store")
_STEPS = flags.DEFINE_list("steps", ["results/speculation/steps_cpu.json"],
                           "peer_bench.py:robust's JSON, or several runs (a label: its first run's step)")
_PPL = flags.DEFINE_string("perplexity", "results/speculation/perplexity/results.json",
                           "experiments.perplexity store (configs/perplexity.py:long)")
_OUT = flags.DEFINE_string("out", "results/speculation", "writes summary.md and table.json here")


def main(argv):
  del argv
  rows, md = speculation.table(_HITRATE.value, _NIAH.value, _RULER.value, _STEPS.value, _PPL.value)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  command = " ".join(["python -m experiments.speculation_table", *sys.argv[1:]])
  steps = "`, `".join(_STEPS.value)
  sources = (f"Sources: `{_HITRATE.value}`, `{_NIAH.value}`, `{_RULER.value}`, `{steps}`, `{_PPL.value}` "
             "(each written by its experiment; its own summary.md gives the command).")
  atomic_write_text(out / "summary.md", f"# Robust speculation: the ablation table\n\nReproduce:\n\n```bash\n"
                    f"{command}\n```\n\n{sources}\n\n{md}")
  atomic_write_json(out / "table.json", {"command": command, "rows": rows})
  print(md)


if __name__ == "__main__":
  app.run(main)
