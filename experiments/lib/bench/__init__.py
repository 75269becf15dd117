"""Benchmarks: decode step time per cache method (`caches`), generation throughput and the overlap of the
offloaded fetch with compute (`throughput`, `overlap`), on a prefilled cache built once per prompt (`states`).

Timing rules everywhere: compile outside the timed region, block on every result that a timed call produces
(`jax.block_until_ready`), report medians, and record the machine's load next to the numbers (`timing`).
Nothing here asserts a timing.
"""
