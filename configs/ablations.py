"""SpeCache ablations — k, bits, group size, residual length, 1-bit quantizer, speculative fetch, pre-decoding —
on NIAH and perplexity.

Run (from the repository root):
  python -m experiments.ablations --config=configs/ablations.py          # "cpu": SmolLM2-135M, this CPU
  python -m experiments.ablations --config=configs/ablations.py:gpu --config.model=/path/to/Meta-Llama-3-8B-Instruct
  python -m experiments.ablations --config=configs/ablations.py:test     # random tiny model, seconds
"""
import ml_collections

from experiments.lib import methods
from specache_jax.data import niah

# The paper's SpeCache 1-bit setting; every variant below changes one or two fields of it.
BASE = dict(name="specache", bits=1, group_size=64, residual=64, topk=64)


def variants() -> dict:
  std = methods.standard()
  v = {"full": std["full"], "kivi_1bit": std["kivi_1bit"], "specache_1bit": dict(BASE)}
  for k in (0, 16, 32, 128, 256):                           # prefetch budget k (64 is the base)
    v[f"k{k}"] = dict(BASE, topk=k)
  v["g32"] = dict(BASE, group_size=32)                      # group size g ∈ {32, 64}
  v["b2"] = dict(BASE, bits=2)                              # bits b ∈ {1, 2}
  v["b2_g32"] = dict(BASE, bits=2, group_size=32)
  # residual length R (64 is the base). g must divide R (keys are quantized a whole window at a time), so R = 16
  # and 32 use g = R: r32 beside g32 (R = 64, g = 32) tells the two apart
  for r in (16, 32, 128):
    v[f"r{r}"] = dict(BASE, residual=r, group_size=min(64, r))
  v["kivi_quantizer"] = dict(BASE, one_bit="kivi")          # plain KIVI 1-bit levels (m, M) inside SpeCache
  v["non_speculative"] = dict(BASE, speculative=False)      # κ_t from the real token's own low-bit attention
  v["no_predecode"] = dict(BASE, predecode=False)           # no pre-decoding pass: step 1 without κ_1
  v["exact_on_miss"] = dict(BASE, exact_on_miss=True)      # project extension: synchronous exact fetch on a miss
  return v


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.methods = variants()            # label -> cache settings; references plus the SpeCache variants
  c.run_methods = ",".join(variants())   # labels run, in table order
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.run_parts = "niah,perplexity"   # which sweeps feed the table
  c.output_dir = "runs/ablations"     # niah/ and perplexity/ sub-sweeps, summary.md, results.json
  c.stop_after = 0                  # >0: stop once this many new cells are stored (both sweeps together)
  c.niah = ml_collections.ConfigDict()
  c.niah.lengths = "1024"           # NIAH context lengths (tokens)
  c.niah.depths = "0.25,0.5,0.75"   # NIAH needle depths
  c.niah.needle = niah.DEFAULT_NEEDLE     # the hidden sentence
  c.niah.question = niah.DEFAULT_QUESTION # asked after the haystack
  c.niah.answer_keywords = "sandwich,Dolores Park"   # an answer is checked for these (any case)
  c.niah.match = "all"              # "all" keywords must appear, or "any"
  c.niah.max_new_tokens = 24        # greedy answer length
  c.perplexity = ml_collections.ConfigDict()
  c.perplexity.corpus = "austen"    # "austen" or "paul_graham"
  c.perplexity.num_windows = 1      # windows decoded as one batch
  c.perplexity.window_tokens = 1024 # tokens per window
  c.perplexity.prefix_tokens = 256  # prefilled; the rest teacher-forced through the cache
  c.perplexity.buckets = "0-1024,1024-4096,4096-8192"   # position buckets [lo, hi)
  if arg == "gpu":
    c.model = ""                    # set to a local Llama-3-8B-Instruct checkpoint
    c.dtype = "bfloat16"
    c.niah.lengths = "2048,4096,8000"
    c.niah.depths = "0.1,0.25,0.5,0.75,0.9"
    c.perplexity.num_windows = 4
    c.perplexity.window_tokens = 8192
    c.output_dir = "runs/ablations_gpu"
  elif arg == "test":
    c.model = "tiny-random"
    c.run_methods = "full,k0,non_speculative,no_predecode"
    c.niah.lengths = "336"
    c.niah.depths = "0.5"
    c.niah.max_new_tokens = 4
    c.perplexity.window_tokens = 300
    c.perplexity.prefix_tokens = 40
    c.perplexity.buckets = "0-128,128-300"
    c.output_dir = "/tmp/specache_results/ablations"
  return c
