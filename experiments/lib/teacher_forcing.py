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
from specache_jax.model import decoder
from specache_jax.model_config import ModelConfig


def _nll(logits_BV, target_B):
  """[B] float32 -log softmax(logits)[target]."""
  logp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, target_B[:, None], axis=-1)[:, 0]


def max_len_for(total_tokens: int) -> int:
  """Cache slots for `total_tokens` (+ room for a speculative row), as `decode` rounds them."""
  return decode.slots_for(total_tokens)


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
  cache = decode.init_cache(method, cfg, b, max_len_for(t), params["embed"].dtype)
  logits, cache = decode.prefill(params, cfg, method, tokens_BT[:, :prefix], jnp.full((b,), prefix, jnp.int32),
                                 cache)
  first = _nll(logits, tokens_BT[:, prefix])
  inp, cache, _ = decode.start(params, cfg, method, tokens_BT[:, prefix], cache)
  cache = decoder.per_layer(cache, cfg.n_layers)                  # decoding steps update each layer in place
  layer_params = decoder.unstack_params(params, cfg.n_layers)
  every_row = jnp.ones((b,), bool)

  def step(carry, xs):
    cache, inp, missed = carry
    tok_B, target_B = xs
    inp = inp.at[:, 0].set(tok_B)                                 # the real row is always the true token
    if spec_row == "text" and method.speculation.width > 1:       # the first guess is the true next token
      inp = inp.at[:, 1].set(target_B)
    if method.speculation.width > 1:     # as the decode loop: the last step's misses, where this input copies from
      cache = decode.observe_speculation(method, cache, missed, inp)
    logits, cache, _ = decoder.forward(layer_params, cfg, inp, cache, method, "decode")
    nll = _nll(logits[:, 0], target_B)
    _, _, missed = decode.speculation(method, inp, target_B, every_row)
    hit = (~missed).astype(jnp.int32) if method.speculation.width > 1 else jnp.zeros((b,), jnp.int32)
    return (cache, decode.next_input(method, inp, target_B, logits, cache.tokens, cache.lengths), missed), (nll, hit)

  xs = (jnp.swapaxes(tokens_BT[:, prefix:t - 1], 0, 1), jnp.swapaxes(tokens_BT[:, prefix + 1:], 0, 1))
  _, (nll_TB, hit_TB) = jax.lax.scan(step, (cache, inp, jnp.zeros((b,), bool)), xs)
  nll = jnp.concatenate([first[:, None], jnp.swapaxes(nll_TB, 0, 1)], axis=1)
  return nll, jnp.sum(hit_TB, axis=0)
