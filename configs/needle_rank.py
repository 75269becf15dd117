"""Where the needle's rows rank in the low-bit scores (issue 14's miss anatomy; experiments/lib/needle_rank.py).

Run (from the repository root):
  python -m experiments.needle_rank --config=configs/needle_rank.py          # SmolLM2-135M, this CPU (~5 min)
  python -m experiments.needle_rank --config=configs/needle_rank.py:test     # random tiny model (seconds)
The NIAH fields (needle, question, lengths, depths, more_needles) are configs/niah.py's.
"""
import ml_collections

from configs import niah


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, test")
  c = niah.get_config("test" if arg == "test" else "cpu")
  for field in ("methods", "run_methods", "extra_methods", "stop_after"):
    del c[field]
  c.lengths = "1024,2048,4096" if arg == "cpu" else c.lengths
  c.depths = "0.1,0.25,0.5,0.75,0.9" if arg == "cpu" else c.depths
  c.rules = "1bit_specache,1bit_kivi,2bit"   # low-bit key rules scored (needle_rank.RULES)
  c.group_size = 64                 # SpeCache's g (per-channel key groups of g tokens)
  c.residual = 64                   # R: the last R prompt positions stay 16-bit (the ring)
  c.topk = 64                       # k: rows fetched per (layer, KV head)
  c.max_new_tokens = 24             # the full cache's greedy answer (as NIAH's), teacher-forced: its rows are scored
  c.output_dir = "runs/needle_rank" if arg == "cpu" else "/tmp/specache_results/needle_rank"
  return c
