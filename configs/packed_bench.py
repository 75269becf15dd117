"""Low-bit attention over packed codes (caches/packed.py) vs dequantize-everything, on this CPU
(experiments/lib/bench/packed.py).

Run (from the repository root):
  python -m experiments.packed_bench --config=configs/packed_bench.py          # "cpu": results/packed_cpu.{json,md}
  python -m experiments.packed_bench --config=configs/packed_bench.py:smoke --config.out=/tmp/p   # seconds
  python -m experiments.packed_bench --config=configs/packed_bench.py --config.render=results/packed_cpu.json
"""
import ml_collections


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "smoke"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, smoke")
  c = ml_collections.ConfigDict()
  c.out = "results/packed_cpu"          # output path without extension (.json and .md)
  c.layers = 3                          # layers per timed program (per-layer time = call / layers)
  c.sizes = (1024, 4096, 8192, 32768)   # cached lengths S
  c.batches = (1, 4)                    # batch sizes B
  c.bits = (1, 2)                       # code widths
  c.variants = ""                       # variants to time, comma-separated ("": all); a checked variant brings
                                        # its reference
  c.rounds = 7                          # timed rounds per cell (median reported)
  c.render = ""                         # a JSON report: only re-render its markdown (written next to it)
  if arg == "smoke":
    c.sizes, c.batches, c.bits, c.rounds = (1024,), (1,), (1,), 3
  return c
