"""The public surface: load_model, forward, generate, cache_config (re-exported by `specache_jax`)."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import decode
from specache_jax.caches import CacheConfig, cache_config
from specache_jax.model.config import ConfigError
from specache_jax.model.decoder import forward_full


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


def check_tokens(cfg, tokens, lengths, max_new_tokens: int = 0, extra: int = 0) -> None:
  """Validate a batch before anything is compiled: empty prompts, lengths, vocabulary, context."""
  if tokens.shape[0] == 0:
    raise ValueError("the batch is empty: tokens has shape "f"{tokens.shape}")
  if np.any(lengths <= 0):
    raise ValueError(f"empty prompt: prompt lengths {lengths.tolist()} must all be >= 1")
  if np.any(lengths > tokens.shape[1]):
    raise ValueError(f"lengths {lengths.tolist()} exceed the token array width {tokens.shape[1]}")
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  bad = valid & ((tokens < 0) | (tokens >= cfg.vocab_size))
  if np.any(bad):
    r, c = np.argwhere(bad)[0]
    raise ValueError(f"token id {int(tokens[r, c])} at row {r}, position {c} is outside the vocabulary "
                     f"[0, {cfg.vocab_size})")
  need = int(lengths.max()) + max_new_tokens + extra
  if need > cfg.max_position:
    raise ValueError(f"prompt length {int(lengths.max())} + max_new_tokens {max_new_tokens}"
                     f"{f' + {extra}' if extra else ''} = {need} exceeds the model's context "
                     f"max_position={cfg.max_position}")


def forward(model, tokens, lengths=None):
  """Cache-free logits: tokens int32 [B, T] -> float32 [B, T, V]."""
  params, cfg = _model_parts(model)
  toks, lens = pad_prompts(tokens)
  if lengths is not None:
    lens = np.asarray(lengths, np.int32)
  check_tokens(cfg, toks, lens)
  return forward_full(params, cfg, jnp.asarray(toks), jnp.asarray(lens))


def generate(model, tokens, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
             cache: CacheConfig | str | None = None, lengths: Sequence[int] | None = None, seed: int = 0,
             rng=None, stop_tokens: Sequence[int] | None = None, return_stats: bool = False):
  """Generate `max_new_tokens` per row. tokens: int [B, T] or a ragged list of token lists.

  cache: a method config (`cache_config(...)`) or a method name; default the 16-bit full cache.
  Returns decode.GenerateOutput (tokens [B, max_new_tokens]); with return_stats also a dict of rates.
  """
  params, cfg = _model_parts(model)
  method = cache_config(cache) if isinstance(cache, str) else (cache or cache_config("full"))
  if not isinstance(method, CacheConfig):
    raise ConfigError(f"cache={cache!r} must be a cache method config from sj.cache_config(...) or a name")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
  if temperature < 0:
    raise ValueError(f"temperature={temperature} must be >= 0")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")
  toks, lens = pad_prompts(tokens)
  if lengths is not None:
    lens = np.asarray(lengths, np.int32)
  check_tokens(cfg, toks, lens, max_new_tokens, method.decode_width - 1)
  max_len = decode.slots_for(method, int(lens.max()), max_new_tokens)
  method.validate(cfg, max_len)
  if stop_tokens is None:
    stop_tokens = tuple(cfg.eos_token_ids)
  tokenizer = getattr(model, "tokenizer", None)
  pad_id = int(stop_tokens[0]) if stop_tokens else 0
  del tokenizer
  if rng is None:
    rng = jax.random.key(seed)
  width = -(-toks.shape[1] // 16) * 16
  toks = np.pad(toks, ((0, 0), (0, width - toks.shape[1])))
  if getattr(method, "offload", False):
    from specache_jax.runtime import OffloadRuntime
    runtime = OffloadRuntime(params, cfg, method, toks.shape[0], max_len, prompt_len=toks.shape[1])
    out = runtime.generate(toks, lens, max_new_tokens, rng, temperature, top_p,
                           tuple(int(s) for s in stop_tokens), pad_id)
    return (out, decode.summarize_stats(out.stats)) if return_stats else out
  out = decode.generate_jit(
      params, jnp.asarray(toks), jnp.asarray(lens), rng, jnp.float32(temperature), jnp.float32(top_p),
      cfg=cfg, method=method, max_new_tokens=max_new_tokens, greedy=temperature == 0.0,
      stop_tokens=tuple(int(s) for s in stop_tokens), max_len=max_len, pad_id=pad_id)
  if return_stats:
    return out, decode.summarize_stats(jax.device_get(out.stats))
  return out
