"""Decode step time of every cache method (ratios to `full` in the same run) and measured device bytes.

Run (from the repository root):
  python -m experiments.caches_bench --config=configs/caches_bench.py          # "cpu": SmolLM2, 1k/4k/8k
  python -m experiments.caches_bench --config=configs/caches_bench.py:gpu      # the same on a GPU, longer
  python -m experiments.caches_bench --config=configs/caches_bench.py:test     # tiny random model, seconds
"""
import ml_collections

from experiments.lib import methods


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # a checkpoint name/path, or random:<shape> (lib/bench/models.py; timing only)
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.contexts = (1024, 4096, 8192)   # cache slots S per cell; the prompt is S - margin tokens
  c.batches = (1, 4)                # prompt rows per cell (distinct random prompts, prefilled row by row)
  c.margin = 32                     # slots left free for the timed decode steps (>= warmup + iters + 2)
  c.warmup = 2                      # untimed decode steps (the first compiles)
  c.iters = 7                       # timed rounds: every method runs one step per round (median reported)
  c.seed = 0                        # prompt tokens
  c.methods = dict(methods.standard(), **methods.retrieval())   # label -> settings (experiments/lib/methods.py)
  # The retrieval baselines as a second run (--config.run_methods=full,quest,infllm_b32): the nine methods' states
  # at 8k x 4 rows, all live for the interleaved rounds, ran out of a 24 GB machine (XLA: cannot allocate memory;
  # measured with an earlier, non-donated step; full + quest + infllm_b32 alone now peak at 13.8 GB RSS)
  c.run_methods = "full,kivi_1bit,kivi_2bit,specache_1bit,specache_2bit,streaming,h2o"
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.reference = "full"              # ratios are to this label's numbers in the same cell
  c.target_context = 8192           # issue 3's target: SpeCache (simulated) step <= target_ratio x full here
  c.target_ratio = 1.5
  c.profile_context = 8192          # 0: no profile; else break the SpeCache step down at this context
  c.profile_method = "specache_1bit"
  c.profile_batches = (1, 4)        # profile these batches (reusing the cells' prefilled prompts)
  c.max_seconds = 4800              # cells not started by then are recorded as skipped (with the reason)
  c.max_prefill_s = 900             # per context: once prompt prefills took this long, further rows repeat
  c.out = "results/caches_cpu"      # writes <out>.json and <out>.md
  if arg == "gpu":
    c.model = "random:llama3.2-1b"
    c.dtype = "bfloat16"
    c.contexts = (8192, 32768)
    c.batches = (1, 8)
    c.target_context = 32768
    c.profile_context = 0
    c.max_seconds = 240
    c.max_prefill_s = 60
    c.out = "results/caches_gpu"
  elif arg == "test":
    c.model = "random:tiny"
    c.contexts = (128, 256)
    c.batches = (1, 2)
    c.margin = 16
    c.warmup = 1
    c.iters = 2
    c.methods = dict(
        full=dict(name="full"),
        kivi_2bit=dict(name="kivi", bits=2, group_size=8, residual=16),
        specache_1bit=dict(name="specache", bits=1, group_size=8, residual=8, topk=4),
        specache_2bit=dict(name="specache", bits=2, group_size=8, residual=8, topk=4),
        streaming=dict(name="streaming", match="specache_1bit"),
        h2o=dict(name="h2o", match="specache_1bit"),
        quest=dict(name="quest", match="specache_1bit", page_size=8),
        infllm=dict(name="infllm", match="specache_1bit", n_init=8, block_size=8))
    c.run_methods = "full,kivi_2bit,specache_1bit,specache_2bit,streaming,h2o,quest,infllm"
    c.target_context = 256
    c.profile_context = 256
    c.profile_batches = (1,)
    c.max_seconds = 300
    c.max_prefill_s = 120
    c.out = "/tmp/specache_results/caches_test"
  return c
