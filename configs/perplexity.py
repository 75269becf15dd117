"""Perplexity by position bucket, teacher-forced token by token through each cache method.

Run (from the repository root):
  python -m experiments.perplexity --config=configs/perplexity.py          # "cpu": SmolLM2-135M, 2k tokens
  python -m experiments.perplexity --config=configs/perplexity.py:long     # SmolLM2, 8k tokens (hours on CPU)
  python -m experiments.perplexity --config=configs/perplexity.py:gpu --config.model=/path/to/Meta-Llama-3-8B-Instruct
  python -m experiments.perplexity --config=configs/perplexity.py:essay    # SmolLM2 sanity check: the first
      1,024 tokens of the Paul Graham essays, 16-bit cache only (expect a perplexity of roughly 20–35)
  python -m experiments.perplexity --config=configs/perplexity.py:test     # random tiny model, seconds
  python -m experiments.perplexity --config=configs/perplexity.py:long --config.output_dir=results/speculation/perplexity \
      --config.run_methods=full,specache_1bit,specache_1bit_eom,...        # robust-speculation variants (issue 14)
Override any field from the command line, e.g. `--config.run_methods=full,specache_1bit`.
"""
import ml_collections

from experiments.lib import methods


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "long", "essay", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, long, essay, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.corpus = "austen"               # long text: "austen" (six novels, data/austen) or "paul_graham" (essays)
  c.num_windows = 1                 # windows of consecutive tokens, decoded together as one batch
  # CPU: 2k tokens (~90 ms per teacher-forced step for SmolLM2 here, ~2.5 min per method); the 4k–8k
  # bucket needs the "long" (roughly 20–40 min per method on this CPU) or the "gpu" variant.
  c.window_tokens = 2048            # tokens per window (positions 0 .. window_tokens-1)
  c.prefix_tokens = 512             # prefilled at once; every later token goes through the cache's decode path
  c.buckets = "0-1024,1024-2048"    # position buckets [lo, hi) for the table
  # label -> cache settings (experiments/lib/methods.py: standard, robust, retrieval), plus SpeCache with an
  # oracle speculative row (spec_row="text": the text's true next token instead of the model's own guess).
  c.methods = dict(methods.standard(), **methods.robust(), **methods.retrieval(),   # robust: issue 14's variants
                   specache_1bit_oracle=dict(methods.standard()["specache_1bit"], spec_row="text"),
                   specache_2bit_oracle=dict(methods.standard()["specache_2bit"], spec_row="text"))
  c.run_methods = "full,specache_1bit,specache_2bit,kivi_1bit,streaming,h2o,quest,infllm"   # labels run, in order
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.output_dir = "runs/perplexity"   # results.json (resumable cells), summary.md, perplexity.png
  c.stop_after = 0                  # >0: stop once this many new cells are stored (split a long sweep; tests)
  if arg == "long":                 # SmolLM2's whole 8k context on this CPU: 20–40 min per method
    c.window_tokens = 8192
    c.prefix_tokens = 256
    c.buckets = "0-1024,1024-4096,4096-8192"
    c.run_methods = "full,specache_1bit,specache_2bit"
    c.output_dir = "runs/perplexity_8k"
  elif arg == "essay":              # the model itself, no compression: is the checkpoint loaded right?
    c.corpus = "paul_graham"
    c.window_tokens = 1024
    c.prefix_tokens = 1             # every token after the first is scored through the decode path
    c.buckets = "0-1024"
    c.run_methods = "full"
    c.output_dir = "runs/perplexity_essay"
  elif arg == "gpu":
    c.model = ""                    # set to a local Llama-3-8B-Instruct checkpoint (HF directory or .gguf)
    c.dtype = "bfloat16"
    c.num_windows = 8
    c.window_tokens = 8192
    c.prefix_tokens = 256
    c.buckets = "0-1024,1024-4096,4096-8192"
    c.run_methods = "full,specache_1bit,specache_2bit,kivi_1bit,kivi_2bit,streaming,h2o,quest,infllm"
    c.output_dir = "runs/perplexity_gpu"
  elif arg == "test":
    c.model = "tiny-random"
    c.window_tokens = 300
    c.prefix_tokens = 40
    c.buckets = "0-128,128-300"
    c.run_methods = "full,specache_1bit,kivi_1bit"
    c.output_dir = "/tmp/specache_results/perplexity"
  return c
