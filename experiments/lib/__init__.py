"""The logic behind the `experiments/` launchers (NIAH, perplexity, hit rate, ablations, LongBench).

Each module exposes `run(config, model=None, command=..., log=...)`, reading an ml_collections config (see
`configs/`), writing resumable results under `config.output_dir` and returning a `store.SweepResult` (the
table it printed, the records, what it computed and reused).
"""
