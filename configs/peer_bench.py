"""Ours vs the peer (HF transformers + torch) on the same model, prompts and contexts, in one interleaved run;
the machine's read bandwidth and GEMM rate measured in the same run; our step time vs context (1k -> 32k).

Run (from the repository root):
  python -m experiments.peer_bench --config=configs/peer_bench.py          # "cpu": SmolLM2-135M fp32, this CPU
  python -m experiments.peer_bench --config=configs/peer_bench.py:gpu      # Llama-3.2-1B shape, bf16, one GPU
  python -m experiments.peer_bench --config=configs/peer_bench.py:test     # tiny random model, seconds
  python -m experiments.peer_bench --config=configs/peer_bench.py:robust   # SpeCache 1-bit's robust-speculation
                                       # variants offloaded: step time at 4k, B=1 (results/speculation/steps_cpu)
"""
import ml_collections

from experiments.lib import methods as exp_methods

SPECACHE = dict(name="specache", group_size=64, residual=64, topk=64)   # the paper's settings


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "gpu", "test", "robust"):
    raise ValueError(f"config variant {arg!r} must be one of cpu, gpu, test, robust")
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"          # a checkpoint name/path, or random:<shape> (lib/bench/models.py; timing only)
  c.dtype = ""                      # "" keeps the checkpoint's dtype (SmolLM2: float32); the peer uses the same
  c.hf_weights = "gguf"             # gguf: transformers' own GGUF loader on the file ours loads (as a new user
                                    # would; for SmolLM2 bit-identical to ours); params: our loaded tensors
                                    # converted one by one (any model, incl. random:<shape>)
  c.hf_attn = "sdpa"                # the peer's attention implementation (transformers' default)
  c.hf_device = "cpu"               # torch device of the peer
  c.threads = 0                     # torch threads; 0 = the cores JAX's CPU backend uses (both recorded)
  c.contexts = (1024, 4096, 8192)   # cache slots per cell; the prompt is context - margin random tokens
  c.batches = (1, 4)                # distinct random prompts of equal length decoded together
  c.margin = 64                     # slots left for decoding (>= warmup + rounds * steps + 3)
  c.prompts = "random"              # "random": seeded random tokens; or a corpus (paul_graham | austen):
                                    # consecutive windows of its text (needs the checkpoint's tokenizer)
  c.prefill_rounds = 1              # prefills per method per cell, in rotating order (median reported)
  c.warmup = 2                      # untimed decode steps after the (last) prefill
  c.steps = 8                       # greedy decode steps per timed round, back to back
  c.rounds = 3                      # rounds; every method (ours and the peer's) runs one round in turn
  c.seed = 0
  c.methods = dict(                 # ours: label -> cache settings (experiments/lib/methods.py)
      full=dict(name="full"),
      kivi_2bit=dict(name="kivi", bits=2, group_size=64, residual=128),
      specache_1bit=dict(SPECACHE, bits=1),
      specache_2bit=dict(SPECACHE, bits=2),
      specache_1bit_offload=dict(SPECACHE, bits=1, offload=True))
  c.run_methods = "full,kivi_2bit,specache_1bit,specache_2bit,specache_1bit_offload"
  c.extra_methods = ""              # more labels from the command line, run after run_methods' (see
                                    # experiments/lib/methods.py): "kivi_g32=kivi:bits=2,group_size=32;..."
  c.peers = dict(                   # the peer's: label -> transformers cache (lib/bench/peer.py HFRunner)
      hf_dynamic=dict(cache="dynamic"),
      hf_quanto_2bit=dict(cache="quanto", nbits=2, q_group_size=64, residual_length=128))
  c.run_peers = "hf_dynamic,hf_quanto_2bit"
  c.reference = "hf_dynamic"        # speed ratios are to this label in the same (context, batch) cell
  c.parity = ml_collections.ConfigDict(dict(  # greedy tokens of ours (full) and the peer (dynamic) compared
      batch=2, prompt_len=64, new_tokens=16))
  c.machine = ml_collections.ConfigDict(dict(  # lib/bench/machine.py
      bandwidth_bytes=1 << 30,      # the array summed to measure read bandwidth (>= 1 GiB: well past the caches)
      gemm_n=2048,                  # fp32 [n, n] x [n, n] for the FLOP/s
      repeats=5))                   # best of
  c.scaling = ml_collections.ConfigDict()       # our step time vs context, cache state from random K/V
  c.scaling.enabled = True
  c.scaling.model = "random:smollm2-135m"       # random weights of the model's shape (contexts past its 8k)
  c.scaling.contexts = (1024, 2048, 4096, 8192, 16384, 32768)
  c.scaling.batch = 1
  c.scaling.run_methods = "full,kivi_2bit,specache_1bit,specache_2bit"   # labels of c.methods (jitted path)
  c.scaling.margin = 64
  c.scaling.warmup = 2
  c.scaling.steps = 4
  c.scaling.rounds = 3
  c.targets = ml_collections.ConfigDict(dict(   # issue 10's "done when" rules, checked on the run's medians
      contexts=(1024, 4096, 8192), context=8192, short_context=1024, full="full",
      spec1="specache_1bit,specache_1bit_offload", spec1_min=2.0, spec1_vs_full_short=1.3,
      fast="kivi_2bit,specache_2bit", fast_min=1.5, floor_max=2.0))
  c.max_seconds = 6 * 3600          # cells / curve points not started by then are recorded as skipped
  c.out = "results/peer_cpu"        # writes <out>.json and <out>.md
  c.plot = "results/scaling_cpu.png"  # the step-vs-context curve ("" = none)
  if arg == "gpu":
    c.model = "random:llama3.2-1b"
    c.hf_weights = "params"
    c.dtype = "bfloat16"
    c.hf_device = "cuda"
    c.contexts = (2048, 8192, 32768)
    c.batches = (1, 8)
    c.steps = 16
    c.machine.bandwidth_bytes = 4 << 30
    c.machine.gemm_n = 8192
    c.scaling.model = "random:llama3.2-1b"
    c.scaling.contexts = (2048, 8192, 32768, 131072)
    c.targets.contexts = (2048, 8192, 32768)
    c.targets.context = 32768
    c.targets.short_context = 2048
    c.max_seconds = 1800
    c.out = "results/peer_gpu"
    c.plot = "results/scaling_gpu.png"
  elif arg == "robust":
    # every robust-speculation label offloaded (its critical-path fetches included: the greedy driver tells the
    # runtime which guesses missed) beside the faithful one and the full cache
    robust = {f"{k}_offload": dict(v, offload=True) for k, v in exp_methods.robust().items()}
    c.methods = dict(full=dict(name="full"), specache_1bit_offload=dict(SPECACHE, bits=1, offload=True), **robust)
    c.run_methods = ",".join(c.methods)
    c.run_peers = "hf_dynamic"
    c.contexts = (4096,)
    c.batches = (1,)
    c.scaling.enabled = False
    c.scaling.run_methods = "full"
    c.targets.contexts = (4096,)
    c.targets.context = 4096
    c.targets.short_context = 4096
    c.targets.spec1 = "specache_1bit_offload"
    c.targets.fast = ""
    c.out = "results/speculation/steps_cpu"
    c.plot = ""
  elif arg == "test":
    c.model = "random:tiny"         # lib/bench/models.py SHAPES["tiny"]: head_dim 16
    c.hf_weights = "params"         # the peer built from the same random weights
    c.contexts = (128,)
    c.batches = (2,)
    c.margin = 16
    c.warmup = 3                    # the offloaded runtime's first steps recompile its per-layer calls
    c.steps = 2
    c.rounds = 2
    small = dict(name="specache", group_size=8, residual=8, topk=4)
    c.methods = dict(
        full=dict(name="full"),
        kivi_2bit=dict(name="kivi", bits=2, group_size=8, residual=16),
        specache_1bit=dict(small, bits=1),
        specache_2bit=dict(small, bits=2),
        specache_1bit_offload=dict(small, bits=1, offload=True))
    c.peers.hf_quanto_2bit = dict(cache="quanto", nbits=2, q_group_size=16, residual_length=16)
    c.parity.prompt_len = 24
    c.parity.new_tokens = 12
    c.machine.bandwidth_bytes = 16 << 20
    c.machine.gemm_n = 256
    c.machine.repeats = 2
    c.scaling.model = "random:tiny"
    c.scaling.contexts = (64, 128)
    c.scaling.run_methods = "full,specache_1bit"
    c.scaling.margin = 16
    c.scaling.steps = 2
    c.scaling.rounds = 2
    c.targets.contexts = (128,)
    c.targets.context = 128
    c.targets.short_context = 128
    c.max_seconds = 600
    c.out = "/tmp/specache_results/peer_test"
    c.plot = "/tmp/specache_results/scaling_test.png"
  return c
