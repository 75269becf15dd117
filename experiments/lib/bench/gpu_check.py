"""The stages of the device check (`experiments/gpu_check.sh` runs each, `python -m experiments.gpu_check
--stage=NAME --platform=gpu|tpu`, with its own time limit).

Written for the machine as it is lent (../shared/ENVIRONMENT.md): python3 with jax 0.11.x + CUDA (or a TPU VM),
no network, nothing over 64 MiB carried, no ml_collections, gguf or tensorflow-datasets and no SmolLM2. This
module and its launcher import only jax, numpy and absl at the top; each stage imports the harness and the
library inside its checks, so a module missing on the device fails those checks, recorded, and not the stage.
Every model is random weights of a real shape made on the device. Each check is recorded in OUTDIR/<stage>.json
as it finishes, under the stage's own deadline (`check_record.StageRecord`).

Sizes come from the device (`device_sizing`): its kind picks the peak HBM bandwidth the kernels are compared
with (an unknown kind: the measured copy bandwidth), its memory the model (Llama-3-8B in bf16 from 32 GiB up,
else Llama-3.2-1B) and, on a GPU, the throughput stage's cap at the paper's 48 GB (an A6000).

Stages:
  smoke         the device and its sizing; the imports; a tiny model's greedy tokens: full = SpeCache (k >= n),
                offloaded (both host stores) = simulated, the platform's Pallas path = jnp; copy bandwidth.
  kernel_tests  the compiled GPU kernel tests (pytest, the `*Interpret` classes deselected); a dry run collects
                them; on a TPU the kernels stage checks the compiled Mosaic kernels instead.
  kernels       the platform's Pallas kernels (Triton on a GPU, Mosaic in pallas_kernels/tpu/ on a TPU) vs their
                float32 references, then timed on a realistic shape with the fraction of the peak bandwidth.
  overlap       the offloaded runtime's fetch-hidden fraction per host store on real shapes at 8k/32k, batch 1/8,
                and a jax.profiler trace of three pipelined steps (OUTDIR/trace_overlap).
  throughput    decode tok/s of the full cache vs SpeCache 1-bit (offloaded; simulated with the platform's
                kernels) at the largest batch each fits.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import jax
import numpy as np

from experiments.lib.bench.check_record import StageRecord

STAGES = ("smoke", "kernel_tests", "kernels", "overlap", "throughput")
PLATFORMS = ("gpu", "tpu")
SPECACHE = dict(bits=1, group_size=64, residual=64, topk=64)
PAPER_DEVICE_BYTES = 48 * 2 ** 30            # the paper's device (an A6000, 48 GB): the throughput stage's cap
BIG_MODEL_MIN_BYTES = 32 * 2 ** 30           # Llama-3-8B in bf16 (16 GB of weights) from here up
# Peak HBM bandwidth (vendor specifications) by device kind: the first key found in the lower-cased
# `device.device_kind` wins ("NVIDIA H100 80GB HBM3" is the SXM card; PCIe and NVL name themselves).
PEAK_BYTES_PER_S = (("h200", 4.8e12), ("h100 pcie", 2.0e12), ("h100 nvl", 3.9e12), ("h100", 3.35e12),
                    ("a100-sxm4-80gb", 2.039e12), ("a100-sxm4-40gb", 1.555e12),
                    ("tpu v6 lite", 1.64e12), ("tpu v5 lite", 8.19e11), ("tpu v4", 1.2e12))
GPU_KERNEL_TESTS = ("tests/test_kernels_mixed_attention.py", "tests/test_kernels_quant_scores.py")
NOT_INTERPRET = "not Interpret"              # pytest -k: the compiled classes only (their *Interpret subclasses
                                             # run the same tests in interpret mode, for the CPU)


@dataclasses.dataclass(frozen=True)
class DeviceSizing:
  """What the check sizes from the device. peak_bytes_per_s None: an unknown kind (the kernels stage compares
  with the measured copy bandwidth); memory_fraction None: no cap (a TPU, or a card of at most 48 GB)."""
  kind: str
  platform: str
  memory_bytes: int | None
  peak_bytes_per_s: float | None
  memory_fraction: float | None
  model: str


def device_sizing(kind: str, memory_bytes: int | None, platform: str = "gpu") -> DeviceSizing:
  """The sizes for a device of this kind and memory (a pure function of the two)."""
  if platform not in PLATFORMS:
    raise ValueError(f"{platform=} is not one of {PLATFORMS}")
  lower = kind.lower()
  peak = next((v for k, v in PEAK_BYTES_PER_S if k in lower), None)
  fraction = None
  if platform == "gpu" and memory_bytes and memory_bytes > PAPER_DEVICE_BYTES:
    fraction = math.floor(PAPER_DEVICE_BYTES / memory_bytes * 1000) / 1000     # at most 48 GiB
  big = memory_bytes is None or memory_bytes >= BIG_MODEL_MIN_BYTES
  return DeviceSizing(kind=kind, platform=platform, memory_bytes=memory_bytes, peak_bytes_per_s=peak,
                      memory_fraction=fraction, model="random:llama3-8b" if big else "random:llama3.2-1b")


def nvidia_smi() -> tuple[str, int] | None:
  """(name, total memory in bytes) of GPU 0 from nvidia-smi, without starting JAX's backend; None without it."""
  if not shutil.which("nvidia-smi"):
    return None
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    name, mib = out.strip().splitlines()[0].rsplit(",", 1)
    return name.strip(), int(float(mib)) * 2 ** 20
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return None


def prepare_environment(stage: str, platform: str, dry: bool) -> str | None:
  """Before JAX starts its backend: the throughput stage on a GPU caps device memory at the paper's 48 GB
  (XLA_PYTHON_CLIENT_MEM_FRACTION from nvidia-smi's memory.total, unless already set). Returns the fraction set."""
  if stage != "throughput" or platform != "gpu" or dry or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
    return None
  query = nvidia_smi()
  fraction = device_sizing(*query, "gpu").memory_fraction if query else None
  if fraction:
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(fraction)
  return str(fraction) if fraction else None


def device_memory(platform: str, dry: bool) -> tuple[int | None, str]:
  """The device's memory in bytes and where it was read: nvidia-smi's memory.total on a GPU (JAX's bytes_limit
  is what XLA preallocated, 75% by default), else `memory_stats()["bytes_limit"]`."""
  if platform == "gpu" and not dry:
    query = nvidia_smi()
    if query:
      return query[1], "nvidia-smi memory.total"
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return (int(limit), "memory_stats bytes_limit") if limit else (None, "unknown")


@dataclasses.dataclass
class Context:
  """What every stage gets: where it runs and what it is sized for."""
  platform: str
  dry: bool
  out_dir: str
  sizing: DeviceSizing

  @property
  def on_device(self) -> bool:
    return not self.dry and jax.default_backend() == self.platform


def measure_sizing(platform: str, dry: bool) -> dict:
  memory, source = device_memory(platform, dry)
  kind = jax.devices()[0].device_kind
  sizing = device_sizing(kind, memory, platform)
  return dict(dataclasses.asdict(sizing), memory_source=source, devices=[str(d) for d in jax.devices()],
              mem_fraction_env=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""))


def _sizes(ctx: Context) -> dict:
  if ctx.dry:
    return dict(model="random:tiny", dtype="float32", cells=[(256, 1), (512, 2)], batches=(4, 2, 1),
                context=512, steps=2, rounds=1, spec=dict(bits=1, group_size=16, residual=16, topk=16))
  return dict(model=ctx.sizing.model, dtype="bfloat16", cells=[(8192, 1), (8192, 8), (32768, 1), (32768, 8)],
              batches=(64, 32, 16, 8, 4, 2, 1), context=32768, steps=8, rounds=3, spec=SPECACHE)


def median_seconds(fn, args, iters: int) -> float:
  """Median wall time of fn(*args) over `iters` calls, after one call that compiles and warms up."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def copy_bandwidth(n_bytes: int, iters: int = 10) -> dict:
  """Achieved bytes/s of x + 1 over a float32 array of n_bytes (reads and writes it: 2 n_bytes moved)."""
  import jax.numpy as jnp
  seconds = median_seconds(jax.jit(lambda a: a + 1), (jnp.ones((n_bytes // 4,), jnp.float32),), iters)
  return dict(bytes=2 * n_bytes, median_s=seconds, bytes_per_s=2 * n_bytes / seconds)


# ------------------------------------------------------------------------------------------------------------
# smoke

THIRD_PARTY_OK = ("jax", "jaxlib", "numpy", "absl", "ml_dtypes", "opt_einsum", "scipy")


def stage_imports() -> dict:
  """Imports every module the stages use; lists the third-party packages they load beyond jax, numpy, absl."""
  before = set(sys.modules)
  for name in ("specache_jax", "pallas_kernels.benchmark", "experiments.lib.bench.models",
               "experiments.lib.bench.overlap", "experiments.lib.bench.throughput"):
    importlib.import_module(name)
  loaded = {m.split(".")[0] for m in set(sys.modules) - before}
  extra = sorted(loaded - set(sys.stdlib_module_names) - set(THIRD_PARTY_OK) -
                 {"specache_jax", "pallas_kernels", "experiments"} - {m for m in loaded if m.startswith("_")})
  return dict(beyond_jax_numpy_absl=extra, pytest=importlib.util.find_spec("pytest") is not None)


def kernel_impl(ctx: Context) -> str | None:
  """The attention_impl that runs this platform's Pallas kernels; interpret mode in a dry run; None if none."""
  if ctx.dry or not ctx.on_device:
    return "pallas_interpret"
  import pallas_kernels  # optional: per check
  impl = pallas_kernels.default_attention_impl()
  return None if impl == "jnp" else impl


def stage_smoke(rec: StageRecord, ctx: Context) -> None:
  rec.check("imports", stage_imports)
  import specache_jax as sj  # optional: per check
  from experiments.lib.bench import models  # optional: per check

  @functools.cache
  def model():
    return models.load("random:tiny", "float32", seed=1)

  @functools.cache
  def tokens(n: int = 12, **cache) -> np.ndarray:
    m = model()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, m.config.vocab_size, k)] for k in (37, 12, 25)]
    return np.asarray(sj.generate(m, prompts, cache=sj.cache_config(**cache), max_new_tokens=n,
                                  stop_tokens=()).tokens)

  small = dict(name="specache", bits=1, group_size=8, residual=8)
  rec.check("specache_k_ge_n_equals_full",
            lambda: bool(np.array_equal(tokens(name="full"), tokens(topk=64, **small))))
  for store in ("pinned_host", "numpy"):
    rec.check(f"offload_{store}_equals_simulated", lambda store=store: bool(np.array_equal(
        tokens(topk=4, **small), tokens(topk=4, offload=True, host_store=store, **small))))
  impl = kernel_impl(ctx)
  if impl is None:
    rec.skip("pallas_equals_jnp", f"no Pallas attention_impl for {ctx.platform} in this checkout "
             "(pallas_kernels.default_attention_impl() is 'jnp')")
  else:
    n = 12 if ctx.on_device else 4                                      # interpret mode is slow: fewer tokens
    rec.check(f"{impl}_equals_jnp", lambda: bool(np.array_equal(
        tokens(n, topk=4, attention_impl="jnp", **small), tokens(n, topk=4, attention_impl=impl, **small))))
  rec.check("copy_bandwidth", copy_bandwidth, (4 << 20) if ctx.dry else 1 << 30)


# ------------------------------------------------------------------------------------------------------------
# kernel tests (pytest, compiled classes only)

def _junit_summary(path: str) -> dict:
  root = ET.parse(path).getroot()
  suites = [root] if root.tag == "testsuite" else list(root)
  counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
  failed = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]
  return dict(counts, failed=failed[:50])


def stage_kernel_tests(rec: StageRecord, ctx: Context) -> None:
  if ctx.platform == "tpu":
    rec.skip("pytest", "tests/test_kernels_tpu.py runs TPU interpret mode only; the kernels stage checks the "
             "compiled Mosaic kernels against the same references")
    return
  if importlib.util.find_spec("pytest") is None:
    rec.skip("pytest", "pytest is not installed here: the kernel tests did not run (the kernels stage still "
             "checks the kernels against their references)")
    return
  base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", NOT_INTERPRET, *GPU_KERNEL_TESTS]

  def collect() -> dict:
    proc = subprocess.run(base + ["--collect-only"], capture_output=True, text=True, timeout=_timeout(rec, 300))
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    compiled = [i for i in ids if "::TestQuantScores::" in i or "::TestMixedDecodeAttention::" in i]
    return dict(ok=proc.returncode == 0 and bool(compiled) and not any("Interpret" in i for i in ids),
                collected=len(ids), compiled=len(compiled), tail=proc.stdout[-1500:] + proc.stderr[-1500:])

  rec.check("collect", collect)
  if not ctx.on_device:
    return

  def run() -> dict:
    xml = os.path.join(ctx.out_dir, "kernel_tests.xml")
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))    # not tests/conftest.py's CPU flags
    proc = subprocess.run(base + [f"--junitxml={xml}"], capture_output=True, text=True, env=env,
                          timeout=_timeout(rec, 600))
    res = _junit_summary(xml) if os.path.exists(xml) else {}
    ran = res.get("tests", 0) - res.get("skipped", 0)
    return dict(res, rc=proc.returncode, ok=proc.returncode == 0 and ran > 0, tail=proc.stdout[-3000:])

  rec.check("run", run)


def _timeout(rec: StageRecord, cap: float) -> float:
  left = rec.remaining()
  return cap if left is None else max(1.0, min(cap, left - 3.0))


# ------------------------------------------------------------------------------------------------------------
# kernels

def _kernel_functions(platform: str):
  from pallas_kernels.mixed_decode_attention import mixed_decode_attention_reference  # optional: per check
  from pallas_kernels.quant_scores import quant_scores_reference  # optional: per check
  if platform == "tpu":
    from pallas_kernels.tpu.mixed_decode_attention import mixed_decode_attention  # optional: per check
    from pallas_kernels.tpu.quant_scores import quant_scores  # optional: per check
  else:
    from pallas_kernels.mixed_decode_attention import mixed_decode_attention  # optional: per check
    from pallas_kernels.quant_scores import quant_scores  # optional: per check
  return dict(quant_scores=(quant_scores, quant_scores_reference),
              mixed=(mixed_decode_attention, mixed_decode_attention_reference))


def kernel_check(ctx: Context, op: str, label: str, shape, bits: int, dtype, peak: float | None,
                 iters: int) -> dict:
  """One op at one shape: the kernel (compiled on its device, interpret mode elsewhere) vs its float32 reference;
  on the device and the realistic shape also timed, with its fraction of `peak` bytes/s."""
  from pallas_kernels import benchmark  # optional: per check
  kernel, reference = _kernel_functions(ctx.platform)[op]
  kw = dict(bits=bits, group_size=shape.group_size, sm_scale=shape.head_dim ** -0.5)
  kernel = jax.jit(functools.partial(kernel, **kw, interpret=not ctx.on_device))
  reference = jax.jit(functools.partial(reference, **kw))
  args = benchmark.make_inputs(op, shape, bits, dtype, ragged=label == "small")
  err = benchmark.max_errors(kernel(*args), reference(*args))
  out = dict(max_scaled_error=err, ok=err <= (1e-4 if np.dtype(dtype) == np.float32 else 2e-2))
  if ctx.on_device and label == "realistic":
    n_bytes = benchmark.bytes_moved(op, args, shape)
    t_kernel = median_seconds(kernel, args, iters)
    t_ref = median_seconds(reference, args, iters)
    out.update(shape=dataclasses.asdict(shape), bytes=n_bytes, kernel_s=t_kernel, reference_s=t_ref,
               speedup=t_ref / t_kernel, kernel_bytes_per_s=n_bytes / t_kernel,
               fraction_of_peak=n_bytes / t_kernel / peak if peak else None)
  return out


def stage_kernels(rec: StageRecord, ctx: Context) -> None:
  import jax.numpy as jnp
  from pallas_kernels import benchmark  # optional: per check
  peak = ctx.sizing.peak_bytes_per_s
  rec.payload["peak_bytes_per_s"] = peak
  if ctx.on_device:
    copy = rec.check("copy_bandwidth", copy_bandwidth, 1 << 30)
    if peak is None and copy:
      peak = copy["bytes_per_s"]
      rec.payload["peak_bytes_per_s"] = f"{peak:.4g} (measured copy: {ctx.sizing.kind!r} has no known peak)"
  shapes = [("small", benchmark.SMALL, jnp.float32)]
  if ctx.on_device:
    shapes.append(("realistic", benchmark.Shape(), jnp.bfloat16))
  for label, shape, dtype in shapes:
    for bits in (1, 2):
      for op in ("quant_scores", "mixed"):
        rec.check(f"{op}_{label}_{bits}bit", kernel_check, ctx, op, label, shape, bits, dtype, peak,
                  3 if ctx.dry else 20)


# ------------------------------------------------------------------------------------------------------------
# overlap and throughput

def stage_overlap(rec: StageRecord, ctx: Context) -> None:
  from experiments.lib.bench import overlap  # optional: per check
  sz = _sizes(ctx)
  for context, batch in sz["cells"]:
    settings = dict(model=sz["model"], dtype=sz["dtype"], seed=0, method=dict(name="specache", offload=True,
                    **sz["spec"]), context=context, batch=batch, steps=sz["steps"], rounds=sz["rounds"],
                    warmup=2, margin=64, nonspeculative=False, stores=["pinned_host", "numpy"])
    rec.check(f"cell_{context}x{batch}", overlap.main_settings, settings)
  rec.check("trace", _trace_steps, sz, ctx.out_dir)


def _trace_steps(sz: dict, out_dir: str) -> str:
  """A jax.profiler trace of three pipelined offloaded steps (the first cell's shape, numpy store)."""
  import specache_jax as sj  # optional: per check
  from experiments.lib.bench import models  # optional: per check
  from experiments.lib.bench.common import RuntimeDriver, random_prompts  # optional: per check
  context, batch = sz["cells"][0]
  model = models.load(sz["model"], sz["dtype"])
  method = sj.cache_config("specache", offload=True, host_store="numpy", **sz["spec"])
  tokens, lengths = random_prompts(0, batch, context - 64, model.config.vocab_size)
  drv = RuntimeDriver(model, method, batch, context, context - 64)
  carry = drv.prefill(tokens, lengths)
  for _ in range(2):
    carry = drv.step(carry)
  jax.block_until_ready(drv.sync(carry))
  path = os.path.join(out_dir, "trace_overlap")
  with jax.profiler.trace(path):
    for _ in range(3):
      carry = drv.step(carry)
    jax.block_until_ready(drv.sync(carry))
  return path


def _largest_batch(model, method, label: str, sz: dict) -> dict:
  """Decode timing at the largest batch of sz["batches"] that fits (each refusal recorded)."""
  from experiments.lib.bench import states  # optional: per check
  from experiments.lib.bench.common import random_prompts  # optional: per check
  from experiments.lib.bench.throughput import make_runner, time_cell  # optional: per check
  refused = []
  for batch in sz["batches"]:
    tokens, lengths = random_prompts(batch, batch, sz["context"] - 64, model.config.vocab_size)
    slots = states.cell_slots(sz["context"] - 64, 2 + sz["rounds"] * sz["steps"] + 1)
    runner = None
    try:
      runner = make_runner(model, method, tokens, lengths, slots)
      rec = time_cell({label: runner}, 2, sz["steps"], sz["rounds"], batch, model)[label]
      out = {k: v for k, v in rec.items() if isinstance(v, (int, float, str, list))}
      return dict(out, batch=batch, refused=refused)
    except Exception as e:  # out of memory at this batch: try the next smaller one
      refused.append(f"B={batch}: {type(e).__name__}: {str(e)[:160]}")
    finally:
      del runner
  raise RuntimeError(f"no batch of {sz['batches']} fits: {refused}")


def stage_throughput(rec: StageRecord, ctx: Context) -> None:
  import specache_jax as sj  # optional: per check
  from experiments.lib.bench import models  # optional: per check
  sz = _sizes(ctx)
  rec.payload.update(context=sz["context"], model=sz["model"],
                     device_memory_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""))
  loaded = []
  if not rec.check("load_model", lambda: loaded.append(models.load(sz["model"], sz["dtype"])) or True):
    return
  model = loaded[0]
  methods = {"full": dict(name="full"),
             "specache_1bit_offload": dict(name="specache", offload=True, host_store="numpy", **sz["spec"])}
  impl = kernel_impl(ctx) if ctx.on_device else "jnp"                  # interpret mode is too slow to time
  if impl:
    methods[f"specache_1bit_{impl}"] = dict(name="specache", attention_impl=impl, **sz["spec"])
  for label, cache in methods.items():
    rec.check(label, lambda label=label, cache=cache: _largest_batch(model, sj.cache_config(**cache), label, sz))


# ------------------------------------------------------------------------------------------------------------

def run_stage(stage: str, out_dir: str, dry: bool, platform: str = "gpu", deadline_s: float | None = None) -> int:
  """One stage -> OUTDIR/<stage>.json, rewritten after every check; returns the exit code (0 ok, 1 a check or
  the stage failed, 124 stopped by its deadline or a signal)."""
  if stage not in STAGES:
    raise ValueError(f"{stage=} is not one of {STAGES}")
  header = dict(dry_run=dry, platform=platform, backend=jax.default_backend(), jax=jax.__version__)
  rec = StageRecord(out_dir, stage, header, deadline_s or None)
  body = dict(smoke=stage_smoke, kernel_tests=stage_kernel_tests, kernels=stage_kernels, overlap=stage_overlap,
              throughput=stage_throughput)[stage]

  def run(rec: StageRecord) -> None:
    sizing = rec.check("device", measure_sizing, platform, dry)
    ctx = Context(platform, dry, out_dir, device_sizing(**{k: sizing[k] for k in ("kind", "memory_bytes",
                  "platform")}) if sizing else device_sizing("unknown", None, platform))
    body(rec, ctx)

  return rec.run(run)
