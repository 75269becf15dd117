"""Benchmarks (the logic behind the `experiments/*_bench.py` launchers and `gpu_check`): decode step time per
cache method (`caches`), generation throughput and the overlap of the offloaded fetch with compute
(`throughput`, `overlap`), on a prefilled cache built once per prompt (`states`); ours vs HF transformers
(`peer`, its HF side `peer_hf`, `peer_report`, the machine's limits `machine`, `floors`); the CPU kernels
(`cpu_kernels`), κ selection (`topk`), packed low-bit attention (`packed`), prefill attention (`prefill`); the
one-GPU check's stages (`gpu_check`). `launch` is the config-file benchmark launchers' body.

Timing rules everywhere: compile outside the timed region, block on every result that a timed call produces
(`jax.block_until_ready`), report medians, and record the machine's load next to the numbers (`timing`).
Nothing here asserts a timing.
"""
