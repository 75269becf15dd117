"""TFDS builder for the NIAH grid; importing this package registers the "niah_grid" dataset."""
from specache_jax.data.tfds_niah.niah_grid import NiahGrid, NiahGridConfig

__all__ = ["NiahGrid", "NiahGridConfig"]
