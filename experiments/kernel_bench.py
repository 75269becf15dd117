"""Pallas kernels vs their jnp references: checked first, then timed on a GPU (bandwidth vs H200 peak).

  python -m experiments.kernel_bench --out=/tmp/kernel_bench.json             # GPU: check + time
  python -m experiments.kernel_bench --out=/tmp/kernel_bench.json --iters=5   # CPU: check only

On a GPU: both kernels are checked against the reference on a small ragged, poisoned shape and on the
realistic shape (B=4, K=8, G=4, S=32768, H=128, T=2, bf16, bits 1 and 2), then timed there. On the CPU the
kernels only run in interpret mode, so only the small-shape correctness check runs (the JSON says so).
"""
import json
import os

import jax
from absl import app, flags, logging

from pallas_kernels import benchmark

_OUT = flags.DEFINE_string("out", None, "where to write the JSON report", required=True)
_ITERS = flags.DEFINE_integer("iters", 20, "timed iterations per function (median reported)")
_BITS = flags.DEFINE_list("bits", ["1", "2"], "code widths to check and time")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  logging.info("devices: %s", jax.devices())
  report = benchmark.run(bits_list=tuple(int(b) for b in _BITS.value), iters=_ITERS.value)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(report, f, indent=2)
  print(report["mode"])
  for check in report["checks"]:
    print(f"check {check['op']:>12} {check['shape']:>9} bits={check['bits']} {check['dtype']}: "
          f"max |kernel - reference| / max(1, max |reference|) = {check['max_scaled_error']:.2e}")
  for t in report["timings"]:
    print(f"time  {t['op']:>12} bits={t['bits']}: kernel {t['kernel_s'] * 1e3:.3f} ms "
          f"({t['kernel_bytes_per_s'] / 1e12:.2f} TB/s, {100 * t['kernel_fraction_of_h200_peak']:.0f}% "
          f"of H200 peak), reference {t['reference_s'] * 1e3:.3f} ms, speedup {t['speedup']:.1f}x")
  print(f"written to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
