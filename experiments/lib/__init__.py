"""The experiment harness: the logic behind the `experiments/` launchers, outside the library (`specache_jax`
imports nothing from here; the wheel does not install it: it runs from a checkout).

The sweeps (NIAH, perplexity, hit rate, needle rank, ablations, LongBench, RULER) each expose
`run(config, model=None, command=..., log=...)`, reading an ml_collections config (see `configs/`), writing
resumable results under `config.output_dir` and returning a `store.SweepResult` (the table it printed, the
records, what it computed and reused). `methods` turns a config's labels into cache configs, `models` loads the
models (checkpoints, a random tiny one, named random shapes), `launch` holds the flags every launcher shares.
The benchmarks are in `bench/`.
"""
