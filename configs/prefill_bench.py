"""Prefill on this CPU: blockwise causal attention vs the dense reference, alone and inside SmolLM2-135M (fp32)
(experiments/lib/bench/prefill.py: what each part measures).

Run (from the repository root):
  python -m experiments.prefill_bench --config=configs/prefill_bench.py     # results/prefill_cpu.{json,md}
  python -m experiments.prefill_bench --config=configs/prefill_bench.py:smoke --config.out=/tmp/p.json
  python -m experiments.prefill_bench --config=configs/prefill_bench.py --config.parts=model \
      --config.contexts=16384 --config.append=True   # one more part/context merged into the report
"""
import ml_collections

ALL_PARTS = "check,blocks,structure,attention,model,layer,gemm,memory"


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "smoke"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, smoke")
  c = ml_collections.ConfigDict()
  c.out = "results/prefill_cpu.json"   # the JSON report (the .md goes next to it)
  c.parts = ALL_PARTS                  # which parts to run, comma-separated (run in a fixed order)
  c.model = "smollm2-135m"             # checkpoint name or path
  c.contexts = (1024, 4096, 8192)      # prompt lengths T (attention, model; layer: the largest)
  c.rounds = 3                         # timed rounds per variant (median reported)
  c.block_context = 8192               # T of the block-size sweep
  c.block_sizes = "128x128,256x256,512x512,1024x1024,256x512,512x256,128x256,256x128"   # block_q x block_k
  c.old_model_contexts = (1024, 4096, 8192)   # contexts at which the dense (old) whole model is timed
  c.old_model_rounds = 1               # timed rounds of the old whole model
  c.memory_contexts = (8192, 32768)    # contexts of the memory part (compile only)
  c.warmup = True                      # one untimed call per variant before the timed rounds
  c.append = False                     # merge into an existing report at `out` (per part and context) instead
                                       # of starting a new one; every command is recorded
  if arg == "smoke":
    c.parts, c.contexts, c.rounds = "check,attention", (1024,), 1
  return c
