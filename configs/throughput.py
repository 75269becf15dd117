"""Generation throughput (prefill and decode apart), device/host bytes, bytes moved per step, and how much of
SpeCache's fetch the offloaded runtime hides; ratios to the full cache in the same run.

Run (from the repository root):
  python -m experiments.throughput --config=configs/throughput.py          # "cpu": SmolLM2-135M, this CPU
  python -m experiments.throughput --config=configs/throughput.py:gpu --config.out=OUTDIR/throughput_gpu
  python -m experiments.throughput --config=configs/throughput.py:test     # tiny random model, seconds
"""
import ml_collections

SPECACHE = dict(name="specache", bits=1, group_size=64, residual=64, topk=64)   # the paper's 1-bit setting


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # a checkpoint name/path, or random:<shape> (lib/bench/models.py; timing only)
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.contexts = (1024, 2048)         # cache slots per cell; the prompt is context - margin tokens
  c.batches = (1, 4)                # distinct random prompts decoded together
  c.margin = 64                     # slots left for decoding (>= warmup + rounds * steps + 3)
  c.warmup = 3                      # untimed decode steps (the first compiles)
  c.steps = 8                       # decode steps per timed round, back to back
  c.rounds = 3                      # rounds; every method runs one round in turn (median reported)
  c.seed = 0
  c.methods = dict(                 # label -> cache settings (experiments/lib/methods.py)
      full=dict(name="full"),
      kivi_2bit=dict(name="kivi", bits=2, group_size=64, residual=128),
      specache_sim=dict(SPECACHE),
      specache_offload=dict(SPECACHE, offload=True),
      specache_offload_nonspec=dict(SPECACHE, offload=True, speculative=False))
  c.run_methods = "full,kivi_2bit,specache_sim,specache_offload,specache_offload_nonspec"
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.reference = "full"              # ratios are to this label in the same (context, batch) cell
  c.max_seconds = 2400              # cells not started by then are recorded as skipped
  c.overlap = ml_collections.ConfigDict()
  c.overlap.enabled = True          # measure compute alone / fetch alone / pipelined (lib/bench/overlap.py)
  c.overlap.method = dict(SPECACHE, offload=True)
  c.overlap.context = 2048
  c.overlap.batch = 4
  c.overlap.steps = 4               # steps per round
  c.overlap.rounds = 31             # rounds (~1.5 s each here): the fraction's spread shrinks with them
  c.overlap.warmup = 3
  c.overlap.stores = ("pinned_host", "numpy")   # host stores to measure (offload.py), one runtime each
  c.overlap.nonspeculative = True   # also time the non-speculative step under the same XLA flags
  c.overlap.subprocess = True       # a fresh process (so XLA_FLAGS can differ from this one's)
  c.overlap.single_thread_xla = True  # on a CPU backend: single-threaded XLA in that process, its threads on one CPU
  c.overlap.timeout_s = 900
  c.out = "results/throughput_cpu"  # writes <out>.json and <out>.md
  if arg == "gpu":
    c.model = "random:llama3.2-1b"
    c.dtype = "bfloat16"
    c.contexts = (2048, 8192)       # the jnp prefill's [B, K, G, 1024, S] float32 scores bound S·B here
    c.batches = (1, 8)
    c.steps = 16
    c.methods.specache_offload_pallas = dict(SPECACHE, offload=True, attention_impl="pallas")
    c.run_methods += ",specache_offload_pallas"
    c.max_seconds = 150             # gpu_check.sh gives this step 240 s in all
    c.overlap.context = 8192
    c.overlap.batch = 8
    c.overlap.stores = ("pinned_host",)
    c.overlap.subprocess = False    # a GPU needs no special XLA flags: measure in this process
    c.overlap.timeout_s = 120
    c.out = "results/throughput_gpu"
  elif arg == "test":
    c.model = "random:tiny"
    c.contexts = (128,)
    c.batches = (1, 2)
    c.margin = 16
    c.warmup = 3                    # the runtime's first steps recompile its per-layer calls
    c.steps = 3
    c.rounds = 2
    small = dict(name="specache", bits=1, group_size=8, residual=8, topk=4)
    c.methods = dict(
        full=dict(name="full"),
        kivi_2bit=dict(name="kivi", bits=2, group_size=8, residual=16),
        specache_sim=dict(small),
        specache_offload=dict(small, offload=True),
        specache_offload_nonspec=dict(small, offload=True, speculative=False))
    c.overlap.method = dict(small, offload=True)
    c.overlap.context = 128
    c.overlap.batch = 2
    c.overlap.steps = 2
    c.overlap.rounds = 2
    c.overlap.warmup = 3
    c.overlap.timeout_s = 300
    c.max_seconds = 300
    c.out = "/tmp/specache_results/throughput_test"
  return c
