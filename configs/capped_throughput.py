"""Decode throughput under a device-memory cap: each method's largest batch whose planned device bytes (weights +
its device state + one prefill chunk's activations) fit the cap, and its decode tokens/s there and at fractions
of it; ratios to the full cache at its own largest batch (the paper's "batch 3 -> 36, up to 4.6x throughput").

Run (from the repository root):
  python -m experiments.capped_throughput --config=configs/capped_throughput.py        # "cpu": SmolLM2-135M
  python -m experiments.capped_throughput --config=configs/capped_throughput.py:gpu    # Llama-3-8B shape, 32k, 48 GiB
  python -m experiments.capped_throughput --config=configs/capped_throughput.py:gpu --config.plan_only=True
  python -m experiments.capped_throughput --config=configs/capped_throughput.py:test   # tiny random model, seconds
"""
import ml_collections

SPECACHE = dict(name="specache", bits=1, group_size=64, residual=64, topk=64)   # the paper's 1-bit setting


def _methods(spec: dict, kivi: dict) -> dict:
  robust = {k: v for k, v in spec.items() if k != "topk"}                       # the preset picks its own k
  return dict(
      full=dict(name="full"),
      kivi_2bit=dict(kivi),
      specache_1bit_offload=dict(spec, offload=True),                            # faithful, host store real
      specache_1bit_robust_offload=dict(robust, preset="robust", offload=True),
      quest_offload=dict(name="quest", match="specache_1bit_offload", offload=True),    # SpeCache's device
      infllm_offload=dict(name="infllm", match="specache_1bit_offload", offload=True),  # bytes, host store real
      streaming=dict(name="streaming", match="specache_1bit_offload"),
      h2o=dict(name="h2o", match="specache_1bit_offload"))


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # a checkpoint name/path, tiny-random, or random:<shape> (lib/bench/models.py)
  c.dtype = ""                      # "" keeps the checkpoint's dtype (SmolLM2: float32; the CPU kernels' dtype)
  c.contexts = (4096, 8192, 16384)  # cache slots per cell; the prompt is context - margin tokens
  c.cap_gib = 1.0                   # the device-memory cap (GiB): weights + device state + prefill activations
  c.prefill_rows = 1                # sequences prefilled at a time, counted in the plan's activations
  c.margin = 64                     # slots left for decoding (>= warmup + rounds * steps + 3)
  c.warmup = 4                      # untimed decode steps (the first ones compile)
  c.steps = 4                       # decode steps per timed round, back to back
  c.rounds = 3                      # rounds (median reported): warmup + rounds * steps = 16 tokens per cell
  c.fractions = (1.0, 0.5)          # batches measured: these fractions of the max batch (at least 1)
  c.max_measured_batch = 0          # > 0: measure no batch above this (the plan's max batch is still reported)
  c.batch_search_limit = 4096       # the max-batch search looks no higher
  c.plan_only = False               # True: the max batches from shapes only (nothing loaded or run)
  c.seed = 0
  c.methods = _methods(SPECACHE, dict(name="kivi", bits=2, group_size=64, residual=128))
  c.run_methods = ("full,kivi_2bit,specache_1bit_offload,specache_1bit_robust_offload,quest_offload,"
                   "infllm_offload")   # + streaming,h2o: ~1.5 min more per cell on this CPU (each batch
                                    # compiles its own programs)
  c.extra_methods = ""              # more labels: "kivi_g32=kivi:bits=2,group_size=32;..." (experiments/lib/methods.py)
  c.reference = "full"              # ratios are to this label's max batch in the same context
  c.max_seconds = 1320              # batches not started by then are recorded as skipped (each context: an
                                    # equal share of the time left)
  c.out = "results/capped_throughput/cpu"   # writes <out>.json, <out>.md and <out>.png
  c.note = ("SmolLM2 runs in float32 here (the CPU kernels' dtype): the full cache and the host store hold 32-bit "
            "K/V, twice the paper's 16-bit bytes per token next to the same weights. 16k exceeds SmolLM2's 8k "
            "training context: the prompts are random tokens and only time is measured.")   # printed in <out>.md
  if arg == "gpu":                  # the paper's setting: a 7-8B model, 32k, an A6000's 48 GB
    c.model = "random:llama3-8b"    # timing only: the weights' values do not change a step's time
    c.dtype = "bfloat16"
    c.contexts = (32768,)
    c.cap_gib = 48.0
    c.fractions = (1.0, 0.5, 0.25, 0.125)   # SpeCache's max batch holds ~300 GiB of host store: the lower ones fit RAM
    c.run_methods += ",streaming,h2o"
    c.warmup = 3
    c.steps = 8
    c.rounds = 3
    c.max_seconds = 540
    c.out = "results/capped_throughput/gpu"
    c.note = "Random weights with Llama-3-8B's shape in bfloat16 (timing only), the paper's 32k and 48 GB."
  elif arg == "test":
    c.model = "tiny-random"         # 2 layers, head_dim 64 (experiments/lib/models.py)
    c.contexts = (160,)
    c.cap_gib = 3 / 1024            # 3 MiB: max batch full 1, SpeCache 6, the robust preset 2, H2O 6
    c.margin = 32
    c.warmup = 3                    # the runtime's first steps recompile its per-layer calls
    c.steps = 2
    c.rounds = 3
    c.fractions = (1.0, 0.5)
    spec = dict(name="specache", bits=1, group_size=16, residual=16, topk=8)
    c.methods = _methods(spec, dict(name="kivi", bits=2, group_size=16, residual=16))
    c.methods["quest_offload"] = dict(c.methods["quest_offload"], page_size=8)
    c.methods["infllm_offload"] = dict(c.methods["infllm_offload"], n_init=8, block_size=8)
    c.run_methods = "full,specache_1bit_offload,specache_1bit_robust_offload,quest_offload,infllm_offload,h2o"
    c.max_seconds = 300
    c.out = "/tmp/specache_results/capped_throughput_test"
    c.note = "A tiny random model: the pipeline, not the numbers."
  return c
