"""RULER (Hsieh et al. 2024): 13 synthetic long-context tasks per cache method, the paper's per-task table.

The 11 synthetic tasks need no data; qa_1 / qa_2 read the official SQuAD v2.0 dev (dev-v2.0.json) and HotpotQA
dev distractor (hotpot_dev_distractor_v1.json) files from the paths you give.
Run (from the repository root):
  python -m experiments.ruler --config=configs/ruler.py           # "cpu": SmolLM2-135M at 4k, 10 methods, ~2.5 h
  python -m experiments.ruler --config=configs/ruler.py:gpu --config.model=/path/to/Llama-3.1-8B-Instruct \
      --config.squad=/path/to/dev-v2.0.json --config.hotpotqa=/path/to/hotpot_dev_distractor_v1.json
  python -m experiments.ruler --config=configs/ruler.py:test      # random tiny model (pipeline smoke test)
Override any field, e.g. `--config.samples=5 --config.tasks=niah_single_1,vt --config.run_methods=full`.
"""
import ml_collections

from experiments.lib import methods
from specache_jax.data.ruler import SYNTHETIC, TASKS


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.lengths = "4096"                # context lengths: prompt + the task's generation budget <= each
  c.tasks = ",".join(SYNTHETIC)     # comma-separated RULER task names (qa_1, qa_2 need the files below)
  # Samples per task (indices 0..samples-1). 5 x 11 tasks x 8 methods at 4k: about 2 h on 2 idle cores
  # (measured ~27 CPU-s per SmolLM2 sample per method, ~30 CPU-s per compiled program, ~5 programs per method).
  c.samples = 5
  c.seed = 42                       # RULER's default random_seed; a sample is a function of (task, length, i, seed)
  c.squad = ""                      # qa_1: path to SQuAD v2.0 dev, dev-v2.0.json
  c.hotpotqa = ""                   # qa_2: path to HotpotQA dev distractor, hotpot_dev_distractor_v1.json
  c.batch_size = 1                  # rows per sj.generate call (the last batch is padded to this many)
  c.max_new_tokens_cap = 0          # 0 = each task's RULER budget (niah 128, vt 30, cwe 120, fwe 50, qa 32)
  # label -> cache settings (experiments/lib/methods.py): the paper's methods and SpeCache 1-bit's
  # speculation variants (exact_on_miss, skip_ring, the robust preset, ...) and the retrieval baselines
  # Quest and InfLLM at SpeCache 1-bit's device bytes.
  c.methods = dict(methods.standard(), **methods.robust(), **methods.retrieval())
  # Labels run, in order: the 16-bit reference, KIVI 1/2-bit (g64, R128), SpeCache 1/2-bit (g64, R64, k64),
  # SpeCache 1-bit with exact_on_miss, StreamingLLM, H2O, Quest and InfLLM sized to SpeCache 1-bit's device
  # bytes.
  c.run_methods = ("full,kivi_1bit,kivi_2bit,specache_1bit,specache_2bit,specache_1bit_eom,streaming,h2o,quest,"
                   "infllm")
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  # Resumable scratch (git-ignored): a rerun skips finished cells. The committed run is results/ruler
  # (written with --config.output_dir=results/ruler).
  c.output_dir = "runs/ruler"       # results.json (resumable cells), summary.md, heatmap.png
  c.stop_after = 0                  # >0: stop once this many new cells are stored (split a long sweep; tests)
  if arg == "gpu":
    c.model = ""                    # set to a local Llama-3.1-8B-Instruct checkpoint (HF directory or .gguf)
    c.dtype = "bfloat16"
    c.lengths = "32768"
    c.tasks = ",".join(TASKS)       # all 13: set squad and hotpotqa
    c.samples = 100
    c.batch_size = 4
    c.output_dir = "runs/ruler_gpu"
  elif arg == "test":
    c.model = "tiny-random"
    c.lengths = "2048"              # characters of the tiny model's tokenizer
    c.samples = 1
    c.batch_size = 1
    c.max_new_tokens_cap = 4        # one generation budget: one compiled program per method
    c.run_methods = "full,specache_1bit"
    c.output_dir = "/tmp/specache_results/ruler"
  return c
