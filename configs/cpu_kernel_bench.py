"""The XLA:CPU decoding kernels (specache_jax.cpu_kernels) vs XLA on this CPU: a step's weight products, SpeCache
1-bit's per-layer kernels, whole decoding steps (experiments/lib/bench/cpu_kernels.py).

Run (from the repository root):
  python -m experiments.cpu_kernel_bench --config=configs/cpu_kernel_bench.py   # results/cpu_kernels.{json,md}
  python -m experiments.cpu_kernel_bench --config=configs/cpu_kernel_bench.py:smoke --config.out=/tmp/ck
"""
import ml_collections

from experiments.lib import methods


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "smoke"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, smoke")
  c = ml_collections.ConfigDict()
  c.out = "results/cpu_kernels"     # output path without extension (.json and .md)
  c.rows = (1, 2, 4, 8)             # products: rows M
  c.methods = methods.standard()    # steps: label -> cache settings (experiments/lib/methods.py; jitted path)
  c.run_methods = "full,kivi_2bit,specache_1bit"
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.contexts = (1024, 8192)         # layers and steps: cached tokens
  c.batches = (1, 2, 4)             # layers and steps: batch sizes
  c.rounds = 7                      # timed rounds (median reported)
  c.steps = 4                       # steps: decoding steps per round, back to back
  if arg == "smoke":
    c.rows, c.contexts, c.batches, c.rounds, c.steps = (1,), (256,), (1,), 2, 1
  return c
