"""A TFDS builder for LongBench jsonl files the user already has (nothing is downloaded).

Importing this package registers the builder ``longbench`` (one config per task), so
``tfds.data_source("longbench/qasper", data_dir=..., builder_kwargs={"jsonl_dir": ...})`` builds and reads it.
"""
from specache_jax.data.tfds_longbench.builder import (  # noqa: F401
    CONFIG_NAMES, LongBench, config_name, example_from_record, load_data_source)
