"""Pallas kernels for the low-bit path: packed-key scoring and fused mixed-precision decode attention.

  from pallas_kernels.quant_scores import quant_scores                      # + QuantScoresBlock, *_reference
  from pallas_kernels.mixed_decode_attention import mixed_decode_attention  # + MixedAttentionBlock, *_reference

Both target the Triton GPU backend (`quant_scores.py` says why not Mosaic GPU) and run on the CPU in
interpret mode. Each op has a float32 jnp `*_reference` with the same signature. `pallas_kernels/tpu/` holds
the Mosaic TPU kernels of the same two ops, with the same contracts and checked against the same references.
The functions are not re-exported here: their names equal their modules' names.
"""
import jax

# Code widths the packed layout supports (docs/design.md: b in {1, 2, 4, 8}), here and in specache_jax.quant.
BITS = (1, 2, 4, 8)



def default_attention_impl() -> str:
  """The explicit `attention_impl` (specache_jax.dispatch) of this backend's Pallas kernels: "pallas" (Triton)
  on a GPU, "pallas_tpu" (Mosaic) on a TPU, else "jnp" (Pallas runs only in interpret mode on the CPU)."""
  return {"gpu": "pallas", "tpu": "pallas_tpu"}.get(jax.default_backend(), "jnp")
