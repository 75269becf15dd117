"""Teacher-forced negative log-likelihood through a cache, token by token, in one jitted `lax.scan`.

A prefix of `prefix` tokens is prefilled; every later token then enters the cache the way a decoded token
does (`phase="decode"`), so a compressed cache's error accumulates as it would in generation. The real row
is always the true token. For a method that decodes two rows (SpeCache), the speculative row is the model's
own greedy guess of the next token — the argmax of the previous step's speculative row, as in decoding
(`decode.generate_jit`); the first guess comes from the pre-decoding pass over the first true token.
`spec_row="text"` feeds the text's true next token instead (an oracle speculation: the best case for the
fetch set, which isolates the low-bit error from speculation misses).

  nll[b, i] = -log p(tokens[b, prefix + i] | tokens[b, :prefix + i]),  i = 0 .. T - prefix - 1
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specache_jax import decode
from specache_jax.caches.base import CacheConfig
from specache_jax.model.config import ModelConfig
from specache_jax.model.decoder import forward


def _nll(logits_BV, target_B):
  """[B] float32 -log softmax(logits)[target]."""
  logp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, target_B[:, None], axis=-1)[:, 0]


def max_len_for(total_tokens: int) -> int:
  """Cache slots for `total_tokens` (+ room for a speculative row), rounded as `decode` rounds them."""
  return -(-(total_tokens + 2) // decode.SLOT_ROUNDING) * decode.SLOT_ROUNDING


SPEC_ROWS = ("model", "text")


@functools.partial(jax.jit, static_argnames=("cfg", "method", "prefix", "spec_row"))
def teacher_forced_nll(params, tokens_BT, *, cfg: ModelConfig, method: CacheConfig, prefix: int,
                       spec_row: str = "model"):
  """tokens [B, T] int32 (every row T real tokens) -> (nll [B, T - prefix] float32, spec_hits [B] int32).

  spec_hits counts the steps whose speculative guess equalled the true next token (0 for one-row methods).
  """
  b, t = tokens_BT.shape
  if spec_row not in SPEC_ROWS:
    raise ValueError(f"{spec_row=} must be one of {SPEC_ROWS}")
  if not 1 <= prefix < t:
    raise ValueError(f"{prefix=} must be in [1, {t}) for {t} tokens")
  dtype = params["embed"].dtype
  cache = decode.init_cache(method, cfg, b, max_len_for(t), dtype)
  lengths = jnp.full((b,), prefix, jnp.int32)
  logits, cache, _ = forward(params, cfg, tokens_BT[:, :prefix], cache, method, "prefill",
                             prompt_lengths=lengths, logits_at=lengths - 1)
  first = _nll(logits[:, 0], tokens_BT[:, prefix])
  two_rows = method.decode_width == 2
  if method.uses_predecode:
    logits_p, cache, _ = forward(params, cfg, tokens_BT[:, prefix:prefix + 1], cache, method, "predecode")
    guess = jnp.argmax(logits_p[:, 0], axis=-1).astype(jnp.int32)
  else:
    guess = jnp.zeros((b,), jnp.int32)

  def step(carry, xs):
    cache, guess = carry
    tok_B, target_B = xs
    if spec_row == "text":
      guess = target_B
    inp = jnp.stack([tok_B, guess], axis=1) if two_rows else tok_B[:, None]
    logits, cache, _ = forward(params, cfg, inp, cache, method, "decode")
    nll = _nll(logits[:, 0], target_B)
    hit = (guess == target_B).astype(jnp.int32)
    if two_rows:                              # as decode.generate_jit: tell the method when its guess missed
      cache = decode.observe_speculation(method, cache, guess != target_B)
    guess = jnp.argmax(logits[:, 1], axis=-1).astype(jnp.int32) if two_rows else guess
    return (cache, guess), (nll, hit)

  xs = (jnp.swapaxes(tokens_BT[:, prefix:t - 1], 0, 1), jnp.swapaxes(tokens_BT[:, prefix + 1:], 0, 1))
  (_, _), (nll_TB, hit_TB) = jax.lax.scan(step, (cache, guess), xs)
  nll = jnp.concatenate([first[:, None], jnp.swapaxes(nll_TB, 0, 1)], axis=1)
  hits = jnp.sum(hit_TB, axis=0) if two_rows else jnp.zeros((b,), jnp.int32)
  return nll, hits
