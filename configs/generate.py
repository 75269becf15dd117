"""Generate a completion for one prompt with any cache method.

  python -m experiments.generate --config=configs/generate.py --config.prompt="What is the capital of France?"
  python -m experiments.generate --config=configs/generate.py --config.model=/path/to/Llama-3.1-8B-Instruct \
      --config.cache=specache --config.cache_settings="bits=1,topk=64,offload=True"
  python -m experiments.generate --config=configs/generate.py:tiny      # random tiny model, any CPU, seconds
Add --mesh=DATA,MODEL to shard over devices, --distributed on every host of a multi-host run.
"""
import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
  if arg not in ("default", "tiny"):
    raise ValueError(f"config variant {arg!r} must be one of default, tiny")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # registered name, .gguf file, HF or orbax directory, or "tiny-random"
  c.dtype = ""                      # "" keeps the checkpoint's dtype; or float32 | bfloat16 | float16
  c.prompt = "What is the capital of France?"
  c.chat = True                     # wrap the prompt in the checkpoint's own chat template
  c.max_new_tokens = 32
  c.temperature = 0.0               # 0 = greedy
  c.top_p = 1.0
  c.seed = 0
  c.cache = "full"                  # full | kivi | specache | streaming | h2o
  c.cache_settings = ""             # e.g. "bits=1,group_size=64,residual=64,topk=64,offload=True"
  c.stats = False                   # print SpeCache's hit rates (and other decode statistics)
  if arg == "tiny":
    c.model = "tiny-random"
    c.max_new_tokens = 16
  return c
