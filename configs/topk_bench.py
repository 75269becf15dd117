"""κ selection on this CPU: one `lax.top_k` over all S slots vs the blocked exact top-k
(experiments/lib/bench/topk.py).

Run (from the repository root):
  python -m experiments.topk_bench --config=configs/topk_bench.py          # "cpu": results/topk_cpu.{json,md}
  python -m experiments.topk_bench --config=configs/topk_bench.py:smoke --config.out=/tmp/t   # seconds
"""
import ml_collections


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "smoke"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, smoke")
  c = ml_collections.ConfigDict()
  c.out = "results/topk_cpu"            # output path without extension (.json and .md)
  c.sizes = (1024, 4096, 8192, 32768)   # cached lengths S
  c.batches = (1, 4)                    # batch sizes B
  c.blocks = (256, 512, 1024, 2048)     # block sizes of the blocked variant
  c.k = 64                              # rows selected per KV head (the paper's)
  c.layers = 10                         # score arrays per timed program (a decode step's layers)
  c.rounds = 7                          # timed rounds (median reported)
  if arg == "smoke":
    c.sizes, c.batches, c.blocks, c.rounds = (1024,), (1,), (256,), 3
  return c
