"""Needle in a Haystack: context lengths × needle depths × cache methods (the project's main job).

Run (from the repository root):
  python -m experiments.niah --config=configs/niah.py          # "cpu": SmolLM2-135M on this CPU, ≤ 10 min
  python -m experiments.niah --config=configs/niah.py:gpu --config.model=/path/to/Meta-Llama-3-8B-Instruct
  python -m experiments.niah --config=configs/niah.py:test     # random tiny model (pipeline smoke test)
Override any field, e.g. `--config.lengths=1024 --config.run_methods=full,specache_1bit`.
"""
import ml_collections

from experiments.lib import methods
from specache_jax.data import niah


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.lengths = "1024,2048"           # context lengths in tokens (haystack + needle + question, chat-formatted)
  c.depths = "0.25,0.5,0.75"        # needle depths: 0 = start of the haystack, 1 = end
  c.needle = niah.DEFAULT_NEEDLE    # the sentence hidden in the haystack (the original NIAH needle)
  c.question = niah.DEFAULT_QUESTION   # asked after the haystack
  c.answer_keywords = "sandwich,Dolores Park"   # comma-separated; an answer is checked for them (any case)
  c.match = "all"                   # "all": every keyword must appear; "any": one is enough
  c.more_needles = ""               # a needle set: more needles asked at every cell, comma-separated keys of
                                    # specache_jax.data.niah.NEEDLE_SET (lighthouse, soup, train); "" = none
  c.max_new_tokens = 24             # greedy answer length (stops earlier at EOS)
  # label -> cache settings (experiments/lib/methods.py): the paper's methods and SpeCache 1-bit's
  # robust-speculation variants, e.g. exact_on_miss (on a speculation miss, fetch the real token's own top-k
  # synchronously; off in the paper's method), skip_ring, the robust preset, and the retrieval baselines
  # Quest and InfLLM at SpeCache 1-bit's device bytes.
  c.methods = dict(methods.standard(), **methods.robust(), **methods.retrieval())
  # Labels run, in order: the 16-bit reference, KIVI 1-bit (g64, R128), SpeCache 1-bit and 2-bit (g64, R64,
  # k64), StreamingLLM / H2O sized to SpeCache 1-bit's device bytes, SpeCache 1-bit with exact_on_miss,
  # SpeCache 1-bit with the robust preset (docs/speculation.md), and Quest / InfLLM sized to SpeCache 1-bit's
  # device bytes (InfLLM at its paper's settings does not fit those bytes at 1k-2k on SmolLM2: its cells are
  # not run and the summary says why; infllm_b32 is InfLLM with blocks of 32, scaled to these contexts).
  c.run_methods = ("full,kivi_1bit,specache_1bit,specache_2bit,streaming,h2o,specache_1bit_eom,specache_1bit_robust,"
                   "quest,infllm,infllm_b32")
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  # Resumable scratch (git-ignored): a rerun skips finished cells. The committed run is results/niah
  # (written with --config.output_dir=results/niah).
  c.output_dir = "runs/niah"        # results.json (resumable cells), summary.md, heatmap_<method>.png
  c.stop_after = 0                  # >0: stop once this many new cells are stored (split a long sweep; tests)
  if arg == "gpu":
    c.model = ""                    # set to a local Llama-3-8B-Instruct checkpoint (HF directory or .gguf)
    c.dtype = "bfloat16"
    c.lengths = "1024,2048,4096,6144,8000"
    c.depths = "0.0,0.1,0.25,0.5,0.75,0.9,1.0"
    c.run_methods = "full,kivi_1bit,kivi_2bit,specache_1bit,specache_2bit,streaming,h2o,quest,infllm"
    c.output_dir = "runs/niah_gpu"
  elif arg == "test":
    c.model = "tiny-random"
    c.lengths = "324,336"          # both pad to the same shapes: one compile per method
    c.depths = "0.25,0.75"
    c.max_new_tokens = 6
    c.run_methods = "full,kivi_1bit,specache_1bit"
    c.output_dir = "/tmp/specache_results/niah"
  return c
