"""Package layout (the metadata is in pyproject.toml).

The wheel ships the library only (`specache_jax`, `pallas_kernels`); the launchers (`experiments/`, with their
harness `experiments/lib/`) and their `get_config()` files (`configs/`) run from a checkout. It also ships the
committed Austen texts: `data/austen/` of the checkout becomes `specache_jax/data/austen/` of the wheel, where
`specache_jax.data.corpora` finds them when no checkout is around. The CPU kernels' C++ source
(`specache_jax/cpu_kernels/*.cc`, `*.h`) ships too: it is compiled on the user's machine, for its CPU, by
`python -m specache_jax.cpu_kernels` (a stage of setup.sh) or at first use.
"""
from __future__ import annotations

import setuptools

AUSTEN = "specache_jax.data.austen"
packages = setuptools.find_packages(include=["specache_jax", "specache_jax.*", "pallas_kernels", "pallas_kernels.*"])
setuptools.setup(
    packages=packages + [AUSTEN],
    package_dir={AUSTEN: "data/austen"},
    package_data={AUSTEN: ["*.txt", "SOURCE.md"], "specache_jax.cpu_kernels": ["*.cc", "*.h"]},
)
