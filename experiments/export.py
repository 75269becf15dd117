"""`jax.export` of every method's prefill and decode step for GPU (cuda) and TPU, on any host (no device needed).

  python -m experiments.export --platforms=cuda,tpu --out=/tmp/export

Writes one artifact per (method, phase, platform) — `<method>.<phase>.<platform>.mlirbc` (and `.jaxexport` where
the `flatbuffers` package is installed) — and `custom_calls.json`, and prints the custom calls each holds:
`__gpu$xla.gpu.triton` is a Pallas Triton kernel, `tpu_custom_call` a Pallas Mosaic TPU kernel
(experiments/lib/export.py; the caches keep attention_impl="auto", so this is what a GPU or TPU user runs).
"""
import jax
from absl import app, flags, logging

from experiments.lib import export

_OUT = flags.DEFINE_string("out", None, "folder for the artifacts and custom_calls.json", required=True)
_PLATFORMS = flags.DEFINE_list("platforms", list(export.PLATFORMS), "lowering platforms (cuda, rocm, tpu, cpu)")
_METHODS = flags.DEFINE_list("methods", list(export.METHODS), f"methods, of {sorted(export.METHODS)}")
_PHASES = flags.DEFINE_list("phases", list(export.PHASES), "phases: prefill, decode")
_MODEL = flags.DEFINE_string("model", "tiny-random", "the model (experiments.lib.models.load)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  unknown = sorted(set(_METHODS.value) - set(export.METHODS))
  if unknown:
    raise app.UsageError(f"unknown --methods {unknown}; expected some of {sorted(export.METHODS)}")
  logging.info("jax %s, devices: %s", jax.__version__, jax.devices())
  export.run(_OUT.value, platforms=tuple(_PLATFORMS.value), methods=tuple(_METHODS.value),
             phases=tuple(_PHASES.value), model_name=_MODEL.value)
  print(f"written to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
