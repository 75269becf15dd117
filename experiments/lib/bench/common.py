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
def greedy_next(params, x_BWD, inp_BW, tokens_BS, lengths_B, *, cfg, method):
  """The next decoding input [B, W] after a greedy step (`decode.next_input` of the real row's argmax) and the
  rows whose speculative guesses all missed it [B] bool (`decode.speculation`). tokens_BS, lengths_B: the ids
  stored after the step and their count (the runtime's `tokens`; None without lookup)."""
  logits = dec.lm_head(params, cfg, x_BWD)
  nxt = decode.guess(logits[:, 0])
  _, _, missed = decode.speculation(method, inp_BW, nxt, jnp.ones(nxt.shape, bool))
  return decode.next_input(method, inp_BW, nxt, logits, tokens_BS, lengths_B), missed


@functools.partial(jax.jit, static_argnames=("cfg", "method"))
def first_guesses(params, x_B1D, first_B, tokens_BS, lengths_B, *, cfg, method):
  """The pre-decoding pass's guesses of token 2 [B, C] (`decode.guesses`, with `decode.lookup_guess`)."""
  return decode.guesses(method, dec.lm_head(params, cfg, x_B1D)[:, 0],
                        decode.lookup_guess(method, tokens_BS, lengths_B, first_B))


class RuntimeDriver:
  """Greedy decoding through an `OffloadRuntime` with the next input kept on the device."""

  def __init__(self, model, method, batch: int, max_len: int, prompt_len: int):
    self.params, self.cfg, self.method = model.params, model.config, method
    self.rt = OffloadRuntime(model.params, model.config, method, batch, max_len, prompt_len=prompt_len)
    self.miss_rows = self.seen_rows = 0       # with exact_on_miss (its miss flags come to the host anyway)

  def prefill(self, tokens_BT, lengths_B):
    """Prefill + pre-decoding -> carry (inp [B, W], lengths [B], pending fetches, missed [B] or None), as
    `decode.start` does."""
    lengths = jnp.asarray(lengths_B, jnp.int32)
    return self.start(decode.guess(self.rt.prefill(jnp.asarray(tokens_BT), lengths)), lengths)

  def start(self, first, lengths):
    """The carry after a prefill that gave the first token `first` [B] (the runtime's prefill, or its
    `install_prompt`): the pre-decoding pass where the method has one."""
    if not self.method.speculation.predecodes:
      return decode.start_input(self.method, first), lengths, None, None
    x, pending = self.rt.predecode(first, lengths)
    guesses = first_guesses(self.params, x, first, self.rt.tokens, lengths, cfg=self.cfg, method=self.method)
    return decode.first_input(self.method, first, guesses), lengths, pending, None

  def step(self, carry):
    """One greedy step: the next input is `decode.next_input` of the real row's argmax (`greedy_next`). With
    exact_on_miss the runtime is told which rows' guesses missed (a host sync per step, as `generate` has), and
    they are counted (`miss_rows` of `seen_rows`)."""
    inp, lengths, pending, missed = carry
    miss = np.asarray(missed) if self.rt.reads_misses and missed is not None else None
    if miss is not None:
      self.miss_rows, self.seen_rows = self.miss_rows + int(miss.sum()), self.seen_rows + miss.size
    x, _, pending = self.rt.step(inp, lengths, pending, miss)
    nxt, missed = greedy_next(self.params, x, inp, self.rt.tokens, lengths + 1, cfg=self.cfg, method=self.method)
    return nxt, lengths + 1, pending, missed

  def sync(self, carry):
    """What must be finished for the steps so far to count as done (incl. the issued fetches and ring-flush writes)."""
    inp, lengths, pending, _ = carry
    fetched = [p.result() for p in pending] if pending else []
    return inp, lengths, fetched, self.rt.states, self.rt.store.arrays()
