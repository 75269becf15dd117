"""Decoding steps update the cache in place: read from the compiled programs, not from timings.

A step over the per-layer cache layout (what `generate_jit`'s loop, teacher forcing and the benchmarks run)
must alias every cache buffer to its output and keep no second copy of the cache as scratch; the stacked layout
through a layer scan (the prefill path) does copy, which is what shows the check can fail.
"""
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from experiments.lib.bench import throughput
import specache_jax as sj
from specache_jax import decode
from specache_jax.arrays import tree_nbytes
from specache_jax.model import decoder
from tests.tiny import random_prompts, tiny_model

METHODS = {
    "full": dict(),
    "kivi": dict(bits=2, group_size=16, residual=32),
    "specache": dict(bits=1, group_size=16, residual=32, topk=16),
    "streaming": dict(budget=256, sink=4),
    "h2o": dict(budget=256, recent=64),
}
SLOTS = 2048


def _prefilled(name, batch=2):
  model = tiny_model(seed=3, head_dim=16, n_layers=3)
  method = sj.cache_config(name, **METHODS[name])
  toks, lens = sj.pad_prompts(random_prompts(1, [200, 170][:batch], model.config.vocab_size))
  inp, cache = throughput.prefill_jit(model.params, jnp.asarray(toks), jnp.asarray(lens), cfg=model.config,
                                      method=method, max_len=SLOTS)
  return model, method, inp, cache


def _aliased_params(compiled_text: str) -> set[int]:
  """Parameter numbers the compiled module aliases to an output (`input_output_alias={ {i}: (p, ...) }`)."""
  header = next(line for line in compiled_text.splitlines() if line.startswith("HloModule"))
  if "input_output_alias=" not in header:
    return set()
  return {int(p) for p in re.findall(r"\}: \((\d+), \{", header.split("input_output_alias=", 1)[1])}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", list(METHODS))
def test_decode_step_aliases_every_cache_buffer_and_keeps_no_copy(name, batch):
  """batch 1 matters: there XLA views [1, K, S, H] as [K, S, H] for the attention dot, and (before the
  conditional in attention.write_rows) fused the row write into that view and copied the cache twice."""
  model, method, inp, cache = _prefilled(name, batch)
  assert decoder.is_per_layer(cache.layers)
  layer_params = throughput.unstack_params_jit(model.params, model.config.n_layers)
  lowered = throughput.decode_step_jit.lower(layer_params, inp, cache, cfg=model.config, method=method)
  compiled = lowered.compile()
  n_param_leaves = len(jax.tree.leaves(layer_params)) + 1                 # + the input tokens
  cache_params = {n_param_leaves + i for i, a in enumerate(jax.tree.leaves(cache)) if SLOTS in a.shape}
  aliased = _aliased_params(compiled.as_text())
  assert cache_params <= aliased, f"cache parameters not aliased to outputs: {sorted(cache_params - aliased)}"
  # buffers with an S axis, and the residual ring (read as it was, then rewritten: lowbit.store_ring)
  leaf_shapes = {(tuple(a.shape), str(a.dtype)) for path, a in jax.tree_util.tree_leaves_with_path(cache.layers)
                 if SLOTS in a.shape or "ring" in jax.tree_util.keystr(path)}
  copies = [line.strip()[:200] for line in compiled.as_text().splitlines()
            if " copy(" in line and any(_hlo_shape(s, d) in line.split(" copy(")[0] for s, d in leaf_shapes)]
  assert not copies, "copies of cache buffers:\n" + "\n".join(copies)
  if name == "full":        # the low-bit methods still dequantize into scratch (issue 10's packed path)
    big = tree_nbytes(cache.layers)
    scratch = compiled.memory_analysis().temp_size_in_bytes
    assert scratch < big / 4, f"{scratch=} bytes of scratch for a {big}-byte cache: a copy of the cache"


def _hlo_shape(shape, dtype) -> str:
  """How HLO text writes an array type, e.g. f32[2,2,2048,16]."""
  short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8", "int32": "s32", "bool": "pred"}
  return f"{short.get(dtype, dtype)}[{','.join(str(d) for d in shape)}]"

def test_the_check_sees_the_copies_of_a_layer_scan():
  """The same step over the stacked layout (a `lax.scan`: xs -> ys) needs a second cache as scratch."""
  model, method, inp, cache = _prefilled("full")
  stacked = decoder.stacked(cache)
  step = jax.jit(lambda p, i, c: decoder.forward(p, model.config, i, c, method, "decode")[1], donate_argnums=2)
  scratch = step.lower(model.params, inp, stacked).compile().memory_analysis().temp_size_in_bytes
  assert scratch >= tree_nbytes(stacked.layers)



@pytest.mark.parametrize("name", ["full", "specache"])
def test_rope_tables_are_computed_once_per_step(name):
  """cos/sin are computed once and shared by the layers (`decoder.rope_for`'s fusion barrier): without it
  XLA:CPU fused them into every consumer of a rotated query, once per layer and per element of the low-bit
  scores' query-scale product (SpeCache 1-bit at 8k: ~16 ms of an ~80 ms step)."""
  model, method, inp, cache = _prefilled(name, batch=1)
  layer_params = throughput.unstack_params_jit(model.params, model.config.n_layers)
  text = throughput.decode_step_jit.lower(layer_params, inp, cache, cfg=model.config,
                                           method=method).compile().as_text()
  n_cos = len(re.findall(r" cosine\(", text))
  assert model.config.n_layers >= 3 and n_cos == 1, f"{n_cos} cosine ops in the compiled step"


@pytest.mark.parametrize("name", ["full", "specache"])
def test_the_generate_loop_program_updates_the_prefilled_cache_in_place(name):
  """`generate`'s decoding program (`decode.loop_jit`) takes the state `decode.start_jit` left, donated, and
  returns it: XLA aliases every cache buffer to an output (the loop starts on the prefill's buffers, no copy on
  entry), keeps no copy of one, and JAX reports no donated buffer it could not use."""
  model = tiny_model(seed=3, head_dim=16, n_layers=3)
  method = sj.cache_config(name, **METHODS[name])
  toks, lens = sj.pad_prompts(random_prompts(1, [200, 170], model.config.vocab_size))
  spec = decode.SamplingSpec.make()
  kw = dict(cfg=model.config, method=method)
  state = decode.start_jit(model.params, jnp.asarray(toks), jnp.asarray(lens), jax.random.key(0), spec,
                           max_new_tokens=8, max_len=SLOTS, **kw)
  with warnings.catch_warnings():
    warnings.simplefilter("error")                         # "Some donated buffers were not usable"
    compiled = decode.loop_jit.lower(model.params, state, spec, **kw).compile()
  text = compiled.as_text()
  cache_leaves = [a for a in jax.tree.leaves(state.cache.layers) if SLOTS in a.shape]
  assert len(_aliased_params(text)) >= len(jax.tree.leaves(state))            # the whole state, cache included
  shapes = {_hlo_shape(a.shape, str(a.dtype)) for a in cache_leaves}
  copies = [line.strip()[:200] for line in text.splitlines()
            if " copy(" in line and any(s in line.split(" copy(")[0] for s in shapes)]
  assert not copies, "copies of cache buffers:\n" + "\n".join(copies)
