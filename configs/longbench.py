"""LongBench (v1 / LongBench-E) predictions and official scores per cache method, the paper's per-task table.

Data: download LongBench's data.zip yourself and unpack it; point `data_dir` at the folder of `<task>.jsonl`.
Run (from the repository root):
  # the paper's table (SPECACHE.md §7) on a GPU with LLaMA-3-8B-Instruct:
  python -m experiments.longbench --config=configs/longbench.py:gpu \
      --config.model=/path/to/Meta-Llama-3-8B-Instruct --config.data_dir=/path/to/LongBench/data
  # CPU, SmolLM2-135M, the first examples of each task:
  python -m experiments.longbench --config=configs/longbench.py --config.data_dir=/path/to/LongBench/data
  # the fixtures with a random tiny model (a smoke test of the harness, seconds):
  python -m experiments.longbench --config=configs/longbench.py:test
"""
import ml_collections

from experiments.lib import methods
from specache_jax.data.longbench import PAPER_TASKS


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.data_dir = ""                   # folder with the official <task>.jsonl files (required)
  c.tasks = ",".join(t for t, _ in PAPER_TASKS)   # comma-separated task names; "" = every task file present
  c.limit = 5                       # examples per task (the first ones); 0 = all
  c.max_prompt_tokens = 3500        # middle-truncation budget (the official per-model "maxlen")
  c.max_new_tokens_cap = 0          # 0 = the official per-task generation length; >0 caps it (faster, unofficial)
  c.batch_size = 1                  # prompts per sj.generate call (a ragged batch)
  c.methods = dict(methods.standard(), **methods.retrieval())   # label -> cache settings (experiments/lib/methods.py)
  c.run_methods = "full,specache_1bit"   # labels run, in order
  c.output_dir = "runs/longbench"     # results.json (resumable), <method>/<task>.jsonl, scores.json, summary.md
  c.stop_after = 0                  # >0: stop once this many new predictions are stored
  if arg == "gpu":
    c.model = ""                    # set to a local Llama-3-8B-Instruct checkpoint
    c.dtype = "bfloat16"
    c.limit = 0
    c.max_prompt_tokens = 7500      # LLaMA-3 8k context minus room for the longest generation
    c.batch_size = 4
    c.run_methods = "full,specache_2bit,specache_1bit,quest,infllm"
    c.output_dir = "runs/longbench_gpu"
  elif arg == "test":
    c.model = "tiny-random"
    c.data_dir = "tests/fixtures/longbench"
    c.tasks = ""
    c.limit = 0
    c.max_prompt_tokens = 600
    c.max_new_tokens_cap = 16
    c.batch_size = 2
    c.run_methods = "full,specache_1bit"
    c.output_dir = "/tmp/specache_results/longbench"
  return c
