"""LongBench (v1 / LongBench-E) predictions and official scores per cache method, the paper's per-task table.

Data: download LongBench's data.zip yourself and unpack it; point `data_dir` at the folder of `<task>.jsonl`.
Run (from the repository root):
  # the paper's Table 1, one command per model (variants gpu_<preset>, presets in PRESETS below):
  python -m experiments.longbench --config=configs/longbench.py:gpu_llama3_8b_instruct \
      --config.model=/path/to/Meta-Llama-3-8B-Instruct --config.data_dir=/path/to/LongBench/data
  # ... likewise gpu_llama2_7b_chat, gpu_llama2_13b_chat, gpu_mistral_7b_instruct, gpu_longchat_7b_32k
  # LLaMA-3-8B-Instruct with full and SpeCache 2/1-bit (g64) only (SPECACHE.md §7's numbers):
  python -m experiments.longbench --config=configs/longbench.py:gpu \
      --config.model=/path/to/Meta-Llama-3-8B-Instruct --config.data_dir=/path/to/LongBench/data
  # CPU, SmolLM2-135M, the first examples of each task:
  python -m experiments.longbench --config=configs/longbench.py --config.data_dir=/path/to/LongBench/data
  # the fixtures with a random tiny model (a smoke test of the harness, seconds):
  python -m experiments.longbench --config=configs/longbench.py:test
A gpu_<preset> variant sets the model's context (`max_prompt_tokens`: the official LongBench `model2maxlen`, the
context minus room for the longest generation; inputs truncated in the middle), bfloat16, every example, and
`run_methods` = TABLE1: the 16-bit cache, KIVI and SpeCache at 2 and 1 bits with g = 32 and 64 (SPECACHE.md §6;
KIVI's residual 128, SpeCache's 64 and k = 64), StreamingLLM and H2O at SpeCache 1-bit g64's device bytes, plus
any eviction baseline `config.methods` holds under TABLE1_OPTIONAL's labels. Add rows with
`--config.extra_methods="label=method:key=value,...;..."` (experiments/lib/methods.py), drop some with
`--config.run_methods=...`. The model's own chat template (tokenizer_config.json) wraps the chat tasks' prompts.
"""
import ml_collections

from experiments.lib import methods
from specache_jax.data.longbench import PAPER_TASKS

# The paper's models (SPECACHE.md §6; LongChat-7B-v1.5-32k, KIVI's LongBench model, besides): checkpoint ->
# (context length, max_prompt_tokens = the official LongBench model2maxlen), batch size for one 48-80 GB GPU.
PRESETS = {
    "llama2_7b_chat": dict(checkpoint="meta-llama/Llama-2-7b-chat-hf", context=4096, max_prompt_tokens=3500,
                           batch_size=4),
    "llama2_13b_chat": dict(checkpoint="meta-llama/Llama-2-13b-chat-hf", context=4096, max_prompt_tokens=3500,
                            batch_size=2),
    "mistral_7b_instruct": dict(checkpoint="mistralai/Mistral-7B-Instruct-v0.2", context=32768,
                                max_prompt_tokens=31500, batch_size=1),
    "longchat_7b_32k": dict(checkpoint="lmsys/longchat-7b-v1.5-32k", context=32768, max_prompt_tokens=31500,
                            batch_size=1),
    "llama3_8b_instruct": dict(checkpoint="meta-llama/Meta-Llama-3-8B-Instruct", context=8192,
                               max_prompt_tokens=7500, batch_size=4),
}
VARIANTS = ("cpu", *(f"gpu_{p}" for p in PRESETS), "gpu", "test")


def group32() -> dict:
  """KIVI and SpeCache at g = 32, the paper's other group size (standard()'s labels are g = 64)."""
  std = methods.standard()
  return {f"{label}_g32": dict(std[label], group_size=32)
          for label in ("kivi_2bit", "kivi_1bit", "specache_2bit", "specache_1bit")}


# Table 1's rows, in order (labels of standard() and group32()).
TABLE1 = ("full", "kivi_2bit_g32", "kivi_2bit", "specache_2bit_g32", "specache_2bit",
          "kivi_1bit_g32", "kivi_1bit", "specache_1bit_g32", "specache_1bit", "streaming", "h2o")
# Baselines that join Table 1 when config.methods holds them (added to methods.standard() separately).
TABLE1_OPTIONAL = ("infllm", "quest")


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"config variant {arg!r} must be one of {', '.join(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.model_preset = ""               # gpu_<preset> variants: the PRESETS key (recorded with the config)
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.data_dir = ""                   # folder with the official <task>.jsonl files (required)
  c.tasks = ",".join(t for t, _ in PAPER_TASKS)   # comma-separated task names; "" = every task file present
  c.limit = 5                       # examples per task (the first ones); 0 = all
  c.max_prompt_tokens = 3500        # middle-truncation budget (the official per-model "maxlen")
  c.max_new_tokens_cap = 0          # 0 = the official per-task generation length; >0 caps it (faster, unofficial)
  c.batch_size = 1                  # prompts per sj.generate call (a ragged batch)
  c.methods = dict(methods.standard(), **methods.retrieval(), **group32())   # label -> cache settings
                                                                             # (experiments/lib/methods.py)
  c.run_methods = "full,specache_1bit"   # labels run, in order
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.output_dir = "runs/longbench"     # results.json (resumable), <method>/<task>.jsonl, scores.json, summary.md
  c.stop_after = 0                  # >0: stop once this many new predictions are stored
  if arg.startswith("gpu_"):
    preset = PRESETS[arg[len("gpu_"):]]
    c.model_preset = arg[len("gpu_"):]
    c.model = ""                    # set to a local copy of preset["checkpoint"]
    c.dtype = "bfloat16"
    c.limit = 0
    c.max_prompt_tokens = preset["max_prompt_tokens"]
    c.batch_size = preset["batch_size"]
    c.run_methods = ",".join([*TABLE1, *(m for m in TABLE1_OPTIONAL if m in c.methods)])
    c.output_dir = f"runs/longbench_{c.model_preset}"
  elif arg == "gpu":
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
