"""`jax.export` of every method's prefill and decode step for accelerator platforms, on any host.

Each (method, phase, platform) becomes one serialized artifact, `<method>.<phase>.<platform>.mlirbc` (the
exported StableHLO portable artifact, `Exported.mlir_module_serialized`; with the `flatbuffers` package also the
whole `jax.export.Exported` as `<method>.<phase>.<platform>.jaxexport`, which `jax.export.deserialize` reads
back), and a record of the custom calls its StableHLO holds: `__gpu$xla.gpu.triton` (or `triton_kernel_call`) where a
Pallas Triton kernel was lowered for cuda, `tpu_custom_call` where a Mosaic TPU kernel was lowered for tpu. The
caches keep attention_impl="auto", so what the export holds is what `specache_jax.dispatch` picks for that
platform. Phases: `prefill` (the prompt through a fresh cache -> last logits, cache) and `decode` (one
`decode.decode_step` of the jitted generate loop's state). The offloaded SpeCache exports its runtime's programs
instead: one layer group's prefill and decode (`model.decoder.layer_forward` over the group's layers, the
16-bit cache off the device).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.lib import models
from specache_jax import cpu_kernels, decode
from specache_jax.caches import cache_config
from specache_jax.model import decoder as dec

PLATFORMS = ("cuda", "tpu")
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")
MOSAIC_CALL = "tpu_custom_call"
PHASES = ("prefill", "decode")
SMALL = dict(bits=1, group_size=32, residual=32, topk=8)
# method -> cache_config arguments (the tiny model: head_dim 64, 2 layers); "offload" marks the runtime's programs
METHODS = {
    "full": dict(name="full"),
    "kivi": dict(name="kivi", bits=2, group_size=32, residual=32),
    "specache": dict(name="specache", **SMALL),
    "specache_robust": dict(name="specache", preset="robust", **SMALL),
    "specache_offload": dict(name="specache", offload=True, **SMALL),
    "streaming": dict(name="streaming", budget=32, sink=4),
    "h2o": dict(name="h2o", budget=32, recent=16),
}
_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call\s+@([\w$.\-]+)|call_target_name\s*=\s*"([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Shapes:
  batch: int = 2
  prompt: int = 40          # prompt tokens (the second row: half of it)
  max_len: int = 128        # cache slots
  new_tokens: int = 8       # the decode loop's output columns


def custom_calls(mlir_text: str) -> list[str]:
  """The custom-call targets of a StableHLO module (text), sorted, each once."""
  return sorted({a or b for a, b in _CUSTOM_CALL.findall(mlir_text)})


def kernel_family(calls) -> str | None:
  """'triton', 'mosaic' or None: which Pallas backend's kernel the custom calls hold."""
  if any(c in TRITON_CALLS for c in calls):
    return "triton"
  if MOSAIC_CALL in calls:
    return "mosaic"
  return None


def _cuda_target():
  """Pallas' Triton lowering reads the GPU from the mesh (jax >= 0.11): an abstract H200 (sm_90) without one."""
  gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  auto = (jax.sharding.AxisType.Auto,)           # Explicit (the default) would type every array's sharding
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), axis_types=auto, abstract_device=gpu))


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _prompt(cfg, shapes: Shapes):
  tokens = jax.ShapeDtypeStruct((shapes.batch, shapes.prompt), jnp.int32)
  lengths = jax.ShapeDtypeStruct((shapes.batch,), jnp.int32)
  return tokens, lengths


def _loop_programs(model, method, shapes: Shapes):
  """(prefill fn, args), (decode fn, args) of the jitted generate loop (`decode.generate_jit`'s pieces)."""
  cfg, params = model.config, model.params
  layer_params = dec.unstack_params(params, cfg.n_layers)
  spec = decode.SamplingSpec.make()
  dtype = params["embed"].dtype

  def prefill(params, tokens, lengths):
    cache = decode.init_cache(method, cfg, shapes.batch, shapes.max_len, dtype)
    return decode.prefill(params, cfg, method, tokens, lengths, cache)

  def first_state(params, tokens, lengths):
    logits, cache = prefill(params, tokens, lengths)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    inp, cache, _ = decode.start(params, cfg, method, first, cache)
    cache = dec.per_layer(cache, cfg.n_layers)
    aux = jax.eval_shape(lambda c, i: dec.forward(layer_params, cfg, i, c, method, "decode")[2], cache, inp)
    return decode.begin_state(method, cache, first, inp, jax.random.key(0), spec, shapes.new_tokens, aux)

  def step(layer_params, state):
    return decode.decode_step(layer_params, cfg, method, state, spec)

  prompt = _prompt(cfg, shapes)
  state = jax.eval_shape(first_state, params, *prompt)
  return {"prefill": (prefill, (_abstract(params), *prompt)),
          "decode": (step, (_abstract(layer_params), state))}


def _group_programs(model, method, shapes: Shapes):
  """The offloaded runtime's programs: one layer group (every layer of the tiny model) through `layer_forward`,
  its states on the device (the 16-bit cache is the host store's)."""
  cfg, params = model.config, model.params
  layer_params = tuple(dec.unstack_layers(params["layers"], cfg.n_layers))
  dtype = params["embed"].dtype
  states = jax.eval_shape(lambda: tuple(dec.unstack_layers(
      method.impl.init(method, cfg, shapes.batch, shapes.max_len, dtype), cfg.n_layers)))
  width = method.speculation.width

  def group(phase, lps, tokens, lengths, sts):
    t = tokens.shape[1]
    x = dec.embed(params, tokens)
    rope = dec.rope_for(cfg, phase, lengths, t, dec.row_offsets(method, phase, t))
    out = []
    for lp, st in zip(lps, sts):
      x, st, _ = dec.layer_forward(cfg, method, lp, x, lengths, st, phase, rope)
      out.append(st)
    return x, tuple(out)

  lengths = jax.ShapeDtypeStruct((shapes.batch,), jnp.int32)
  tokens = {"prefill": jax.ShapeDtypeStruct((shapes.batch, shapes.prompt), jnp.int32),
            "decode": jax.ShapeDtypeStruct((shapes.batch, width), jnp.int32)}
  return {phase: (functools.partial(group, phase), (_abstract(layer_params), tokens[phase], lengths, states))
          for phase in PHASES}


def programs(model, method, shapes: Shapes = Shapes()) -> dict:
  """phase -> (function, abstract args) of `method` (a CacheConfig) on `model`."""
  if getattr(method, "offload", False):
    return _group_programs(model, method, shapes)
  return _loop_programs(model, method, shapes)


def _can_serialize() -> bool:
  """Whether `Exported.serialize` works here (it needs the optional `flatbuffers` package)."""
  return importlib.util.find_spec("flatbuffers") is not None


def export_one(fn, args, platform: str) -> jax.export.Exported:
  """`fn` exported for `platform` (Triton's custom call is allowed: jax does not promise its stability)."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in TRITON_CALLS]
  export = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)
  if platform == "cuda":
    with _cuda_target():
      return export(*args)
  return export(*args)


def run(out_dir, platforms=PLATFORMS, methods=tuple(METHODS), phases=PHASES, shapes: Shapes = Shapes(),
        model_name: str = "tiny-random", log=print) -> dict:
  """Exports each (method, phase, platform) into out_dir/<method>.<phase>.<platform>.mlirbc (and .jaxexport:
  `_can_serialize`) and writes
  out_dir/custom_calls.json: {"<method>.<phase>.<platform>": {"custom_calls": [...], "kernel": family}}."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  model = models.load(model_name)
  report = {}
  # The programs are traced without the XLA:CPU kernels unless a cpu export is asked for: a cuda or tpu program
  # never calls them, and their `custom_partitioning` cannot lower under the abstract GPU mesh (jax >= 0.11).
  with contextlib.nullcontext() if "cpu" in platforms else cpu_kernels.disabled():
    for name in methods:
      method = cache_config(**METHODS[name])
      progs = programs(model, method, shapes)
      for phase in phases:
        fn, args = progs[phase]
        for platform in platforms:
          exported = export_one(fn, args, platform)
          key = f"{name}.{phase}.{platform}"
          (out_dir / f"{key}.mlirbc").write_bytes(exported.mlir_module_serialized)
          if _can_serialize():
            (out_dir / f"{key}.jaxexport").write_bytes(exported.serialize())
          calls = custom_calls(exported.mlir_module())
          report[key] = dict(custom_calls=calls, kernel=kernel_family(calls))
          log(f"{key}: {', '.join(calls) or 'no custom calls'}")
  (out_dir / "custom_calls.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
  return report
