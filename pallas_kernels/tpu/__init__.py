"""Pallas Mosaic TPU kernels for the low-bit path, beside the Triton GPU ones in `pallas_kernels/`:

  from pallas_kernels.tpu.quant_scores import quant_scores                      # + QuantScoresTPUBlock
  from pallas_kernels.tpu.mixed_decode_attention import mixed_decode_attention  # + MixedAttentionTPUBlock

Same signatures and semantics as the GPU kernels' float32 references (`pallas_kernels.quant_scores.
quant_scores_reference`, `pallas_kernels.mixed_decode_attention.mixed_decode_attention_reference`, `prob_rows`
included), so one reference checks both backends. They lower for the `tpu` platform on any host and run on the
CPU in TPU interpret mode (`interpret=True` or a `pltpu.InterpretParams`).
"""
