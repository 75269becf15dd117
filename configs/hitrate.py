"""SpeCache's speculation hit rates (exact next token; top-k rows) per layer over a long generation.

Run (from the repository root):
  python -m experiments.hitrate --config=configs/hitrate.py          # "cpu": SmolLM2-135M, this CPU
  python -m experiments.hitrate --config=configs/hitrate.py:gpu --config.model=/path/to/Meta-Llama-3-8B-Instruct
  python -m experiments.hitrate --config=configs/hitrate.py:test     # random tiny model, seconds
"""
import ml_collections

from experiments.lib import methods


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.corpus = "paul_graham"          # prompt text: "paul_graham" (essays) or "austen"
  c.num_prompts = 2                 # prompts (consecutive windows of the text), decoded as one batch
  c.context_tokens = 1024           # tokens per prompt
  c.max_new_tokens = 256            # greedy tokens generated per prompt (no stop token: the full length)
  c.methods = dict(methods.standard(), **methods.robust())   # label -> cache settings (experiments/lib/methods.py)
  c.run_methods = "specache_1bit,specache_2bit"   # SpeCache labels only (track_hits is switched on); robust
                                                  # speculation: e.g. specache_1bit_eom,specache_1bit_robust
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.output_dir = "runs/hitrate"  # results.json (resumable), summary.md, hitrate.png
  c.stop_after = 0                  # >0: stop once this many new cells are stored
  if arg == "gpu":
    c.model = ""                    # set to a local Llama-3-8B-Instruct checkpoint
    c.dtype = "bfloat16"
    c.num_prompts = 8
    c.context_tokens = 7168
    c.max_new_tokens = 1024
    c.output_dir = "runs/hitrate_gpu"
  elif arg == "test":
    c.model = "tiny-random"
    c.num_prompts = 2
    c.context_tokens = 200
    c.max_new_tokens = 24
    c.run_methods = "specache_1bit"
    c.output_dir = "/tmp/specache_results/hitrate"
  return c
