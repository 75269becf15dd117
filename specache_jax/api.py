"""The public surface: load_model, forward, generate, cache_config (re-exported by `specache_jax`)."""
from __future__ import annotations

import contextlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import buckets as _buckets
from specache_jax import clock, decode, guards, sharding, validation
from specache_jax.buckets import BucketPolicy
from specache_jax.caches import CacheConfig, cache_config
from specache_jax.model.decoder import forward_full
from specache_jax.runtime import OffloadRuntime


def _model_parts(model):
  return model.params, model.config


def pad_prompts(prompts, pad_id: int = 0):
  """A list of token lists (ragged) or an int array [B, T] -> (tokens [B, T] int32 right-padded, lengths [B])."""
  if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (list, tuple, np.ndarray)):
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    width = int(lengths.max()) if len(lengths) else 0
    tokens = np.full((len(prompts), max(width, 1)), pad_id, np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = np.asarray(p, np.int32)
    return tokens, lengths
  tokens = np.asarray(prompts)
  if tokens.ndim == 1:
    tokens = tokens[None]
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be int [B, T] or a list of token lists; got shape {tokens.shape}")
  return tokens.astype(np.int32), np.full((tokens.shape[0],), tokens.shape[1], np.int32)


def forward(model, tokens, lengths=None):
  """Cache-free logits: tokens int32 [B, T] -> float32 [B, T, V]."""
  params, cfg = _model_parts(model)
  validation.check_prompt_values(tokens)
  toks, lens = pad_prompts(tokens)
  if lengths is not None:
    lens = np.asarray(lengths, np.int32)
  validation.check_forward(cfg, params, toks, lens)
  return forward_full(params, cfg, jnp.asarray(toks), jnp.asarray(lens))


def generate(model, tokens, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
             cache: CacheConfig | str | None = None, lengths: Sequence[int] | None = None, seed: int = 0,
             rng=None, stop_tokens: Sequence[int] | None = None, return_stats: bool = False, mesh=None,
             check_numerics: bool = False, buckets: BucketPolicy | None = _buckets.DEFAULT):
  """Generate `max_new_tokens` per row. tokens: int [B, T] or a ragged list of token lists.

  cache: a method config (`cache_config(...)`) or a method name; default the 16-bit full cache.
  mesh: a ("data", "model") `jax.sharding.Mesh` (sharding.make_mesh): batch on data, heads on model.
  check_numerics: raise guards.NonFiniteError naming the step and layer where logits or cache entries first
    became NaN/Inf.
  buckets: the shape buckets (`buckets.BucketPolicy`): the programs are compiled for the bucketed prompt width,
    output width and cache slots, so a call whose lengths fall in a warm bucket compiles nothing (the padding
    does not change the tokens); None compiles for the exact lengths.
  Returns decode.GenerateOutput (tokens [B, max_new_tokens]); with return_stats also a dict: the method's rates
  (`decode.summarize_stats`) and the call's timing (`clock.CallClock.stats`: wall_s, ttft_s, decode_s,
  decode_tokens_per_s, compile_s, compilations).
  """
  with clock.CallClock() if return_stats else contextlib.nullcontext() as timer:
    out = _generate(model, tokens, max_new_tokens, temperature, top_p, cache, lengths, seed, rng, stop_tokens, mesh,
                    check_numerics, timer, buckets)
    if not return_stats:
      return out
    timer.stop(out)
  stats = decode.summarize_stats(jax.device_get(out.stats))
  new_tokens = int(np.sum(np.maximum(np.asarray(jax.device_get(out.num_tokens)) - 1, 0)))
  return out, dict(stats, **timer.stats(new_tokens))


def _trimmed(out, max_new_tokens: int):
  """The output's tokens [B, max_new_tokens] of a bucketed buffer [B, out_width], sliced on the host shard by
  shard (no program per width; the array keeps its sharding, and a process touches only its own shards)."""
  tokens = out.tokens
  if tokens.shape[1] == max_new_tokens:
    return out
  shards = [jax.device_put(np.ascontiguousarray(np.asarray(s.data)[:, :max_new_tokens]), s.device)
            for s in tokens.addressable_shards]
  trimmed = jax.make_array_from_single_device_arrays((tokens.shape[0], max_new_tokens), tokens.sharding, shards)
  return out.replace(tokens=trimmed)


def _generate(model, tokens, max_new_tokens, temperature, top_p, cache, lengths, seed, rng, stop_tokens, mesh,
              check_numerics, timer, policy):
  params, cfg = _model_parts(model)
  method = cache_config(cache) if isinstance(cache, str) else (cache or cache_config("full"))
  validation.check_prompt_values(tokens)
  toks, lens = pad_prompts(tokens)
  if lengths is not None:
    lens = np.asarray(lengths, np.int32)
  if stop_tokens is None:
    stop_tokens = tuple(cfg.eos_token_ids)
  max_len, shapes = validation.check_generate(cfg, params, method, toks, lens, max_new_tokens=max_new_tokens,
                                              temperature=temperature, top_p=top_p, stop_tokens=stop_tokens,
                                              mesh=mesh, policy=policy)
  pad_id = int(stop_tokens[0]) if stop_tokens else 0
  if rng is None:
    rng = jax.random.key(seed)
  toks = toks[:, :shapes.prompt_width]                   # bucketed: cut to the longest row, then padded
  toks = np.pad(toks, ((0, 0), (0, shapes.prompt_width - toks.shape[1])))
  stop_tokens = tuple(int(s) for s in stop_tokens)
  if method.offload:
    runtime = OffloadRuntime(params, cfg, method, toks.shape[0], max_len, prompt_len=toks.shape[1], mesh=mesh,
                             check_numerics=check_numerics)
    return _trimmed(runtime.generate(toks, lens, max_new_tokens, rng, temperature, top_p, stop_tokens, pad_id,
                                     clock=timer, out_width=shapes.out_width), max_new_tokens)
  if mesh is not None:
    params = sharding.shard_params(params, cfg, mesh)
    toks_d, lens_d = sharding.shard_batch(mesh, toks, lens)
  else:
    toks_d, lens_d = jnp.asarray(toks), jnp.asarray(lens)
  spec = decode.SamplingSpec.make(temperature, top_p, stop_tokens, pad_id)
  out = decode.generate_jit(params, toks_d, lens_d, rng, spec, cfg=cfg, method=method,
                            max_new_tokens=max_new_tokens, max_len=max_len, mesh=mesh,
                            check_numerics=check_numerics, clock=timer, out_width=shapes.out_width)
  if check_numerics:
    out, record = guards.pop_record(out)
    guards.raise_if_bad(record, cfg.n_layers)
  return _trimmed(out, max_new_tokens)
