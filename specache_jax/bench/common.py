"""What the benchmarks share: seeded random prompts, a failure in a few words, and greedy decoding through the
offload runtime with the next input kept on the device (`RuntimeDriver`)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specache_jax import decode
from specache_jax.model import decoder as dec
from specache_jax.runtime import OffloadRuntime


def random_prompts(seed: int, batch: int, length: int, vocab: int):
  """Distinct seeded random prompts: tokens [B, T] int32, lengths [B] (all T)."""
  rs = np.random.RandomState(seed)
  return rs.randint(0, vocab, size=(batch, length)).astype(np.int32), np.full((batch,), length, np.int32)


def error_reason(e: Exception) -> str:
  """Why a cell was skipped: the exception's type and the first line of its message."""
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def greedy_next(params, x_BWD, inp_BW, *, cfg, method):
  """The next decoding input [B, W] after a greedy step (`decode.next_input` of the real row's argmax)."""
  logits = dec.lm_head(params, cfg, x_BWD)
  return decode.next_input(method, inp_BW, decode.guess(logits[:, 0]), logits)


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def first_guesses(params, x_B1D, *, cfg, method):
  """The pre-decoding pass's guesses of token 2 [B, C] (`decode.guesses`)."""
  return decode.guesses(method, dec.lm_head(params, cfg, x_B1D)[:, 0])


class RuntimeDriver:
  """Greedy decoding through an `OffloadRuntime` with the next input kept on the device."""

  def __init__(self, model, method, batch: int, max_len: int, prompt_len: int):
    self.params, self.cfg, self.method = model.params, model.config, method
    self.rt = OffloadRuntime(model.params, model.config, method, batch, max_len, prompt_len=prompt_len)

  def prefill(self, tokens_BT, lengths_B):
    """Prefill + pre-decoding -> carry (inp [B, W], lengths [B], pending fetches), as `decode.start` does."""
    lengths = jnp.asarray(lengths_B, jnp.int32)
    first = decode.guess(self.rt.prefill(jnp.asarray(tokens_BT), lengths))
    if not self.method.uses_predecode:
      return decode.first_input(self.method, first), lengths, None
    x, pending = self.rt.predecode(first, lengths)
    guesses = first_guesses(self.params, x, cfg=self.cfg, method=self.method)
    return decode.first_input(self.method, first, guesses), lengths, pending

  def step(self, carry):
    """One greedy step: the next input is `decode.next_input` of the real row's argmax (`greedy_next`)."""
    inp, lengths, pending = carry
    x, pending = self.rt.step(inp, lengths, pending)
    return greedy_next(self.params, x, inp, cfg=self.cfg, method=self.method), lengths + 1, pending

  def sync(self, carry):
    """What must be finished for the steps so far to count as done (incl. the issued fetches and ring-flush writes)."""
    inp, lengths, pending = carry
    fetched = [p.result() for p in pending] if pending else []
    return inp, lengths, fetched, self.rt.states, self.rt.store.arrays()
