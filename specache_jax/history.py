"""The ids of the tokens a cache holds, and what prompt lookup reads from them.

A method whose speculation `keeps_tokens` (SpeCache with `lookup > 0`) carries `Cache.tokens` [B, S] int32:
position p holds the id of the token stored at p (the prompt's, then each step's real row). Two uses, both a pass
over [B, S] ids per step, no model call:

  lookup   the token that followed the latest earlier occurrence of the sequence's last tokens (the longest
           suffix of at most `ngram` that occurs): the guess a copying model makes (a needle's answer, a
           repeated phrase, a cycle); SpeCache puts it among its speculative guesses.
  anchors  for each row of the next decoding input, the position right after that occurrence: where an
           induction (copying) head at that row attends. SpeCache's `lookup_rows` fetches the rows around it
           in 16-bit whatever the 1-bit scores say (`selection.anchored`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NONE = -1      # `lookup`'s answer where no suffix of the tokens occurs earlier


def empty(batch: int, slots: int):
  """No tokens yet -> [B, S] int32."""
  return jnp.zeros((batch, slots), jnp.int32)


def write_prompt(tokens_BS, prompt_BT):
  """A right-padded prompt at positions 0..T-1 (the padding is overwritten by the steps that follow)."""
  return jax.lax.dynamic_update_slice(tokens_BS, prompt_BT.astype(jnp.int32), (0, 0))


def write_rows(tokens_BS, rows_BR, lengths_B):
  """R consecutive tokens per row at positions lengths .. lengths + R - 1 (past the end: dropped)."""
  b, r = rows_BR.shape
  pos_BR = lengths_B.astype(jnp.int32)[:, None] + jnp.arange(r, dtype=jnp.int32)[None, :]
  batch_BR = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, r))
  return tokens_BS.at[batch_BR, pos_BR].set(rows_BR.astype(jnp.int32), mode="drop")


def match(tokens_BS, lengths_B, tail_BT, ngram: int):
  """Where the sequence's last tokens occurred before -> (end [B] int32, length [B] int32): the end position of
  the latest earlier occurrence of its longest suffix of at most `ngram` tokens that occurs earlier (the latest
  of that length) and that suffix's length; (`NONE`, 0) where even its last token never occurred before. The
  sequence is tokens[:lengths] then tail [B, T] (tokens not stored yet); an earlier occurrence ends before the
  last tail token's position lengths + T - 1."""
  end_B = lengths_B.astype(jnp.int32) + (tail_BT.shape[1] - 1)               # the last tail token's position
  return _match_in(write_rows(tokens_BS, tail_BT, lengths_B), end_B, ngram)


def _match_in(seq_BS, end_B, ngram: int):
  """`match` on the written sequence seq_BS [B, S] ending at end_B [B]."""
  b, s = seq_BS.shape
  if ngram < 1:
    raise ValueError(f"{ngram=} must be >= 1")
  pos_S = jnp.arange(s, dtype=jnp.int32)
  matched_BS = jnp.zeros((b, s), jnp.int32)          # suffix tokens equal to those ending at i, up to ngram
  alive_BS = jnp.ones((b, s), bool)
  for j in range(ngram):
    ref_B = jnp.take_along_axis(seq_BS, jnp.clip(end_B - j, 0, s - 1)[:, None], axis=1)[:, 0]
    here_BS = jnp.roll(seq_BS, j, axis=1)                                   # seq[i - j] at column i
    alive_BS = alive_BS & (here_BS == ref_B[:, None]) & (pos_S[None, :] >= j)
    matched_BS = matched_BS + alive_BS.astype(jnp.int32)
  earlier_BS = pos_S[None, :] < end_B[:, None]       # (i < end and i >= j: the suffix's j-th token is real)
  key_BS = jnp.where(earlier_BS & (matched_BS > 0), matched_BS * s + pos_S[None, :], -1)
  best_B = jnp.max(key_BS, axis=1)
  found_B = best_B >= 0
  return (jnp.where(found_B, best_B % s, NONE).astype(jnp.int32),
          jnp.where(found_B, best_B // s, 0).astype(jnp.int32))


def lookup(tokens_BS, lengths_B, next_B, ngram: int):
  """The token that followed the latest earlier occurrence of the sequence's last tokens (`match`; the sequence
  is tokens[:lengths] then next, the token just sampled) -> [B] int32, `NONE` where there is none."""
  s = tokens_BS.shape[1]
  seq_BS = write_rows(tokens_BS, next_B[:, None], lengths_B)
  at_B, _ = _match_in(seq_BS, lengths_B.astype(jnp.int32), ngram)
  follow_B = jnp.take_along_axis(seq_BS, jnp.clip(at_B + 1, 0, s - 1)[:, None], axis=1)[:, 0]
  return jnp.where(at_B != NONE, follow_B, NONE).astype(jnp.int32)


def anchors(tokens_BS, lengths_B, inp_BW, ngram: int, min_match: int = 1):
  """Where each row of the next decoding input would copy from -> [B, W] int32: for the real row (T_t, stored
  next at `lengths`), the position after the latest earlier occurrence of the sequence's last tokens ending in
  it; for each speculative row (a guess of T_{t+1}), the same with the guess appended. `NONE` where none, or
  where the matched suffix is shorter than `min_match` tokens. An induction (copying) head at that row attends
  there: the token that followed last time."""
  tails = [inp_BW[:, :1]] + [jnp.stack([inp_BW[:, 0], inp_BW[:, c]], axis=1) for c in range(1, inp_BW.shape[1])]
  cols = [match(tokens_BS, lengths_B, tail, ngram) for tail in tails]
  at_BW = jnp.stack([at for at, _ in cols], axis=1)
  ok_BW = jnp.stack([n for _, n in cols], axis=1) >= max(min_match, 1)
  return jnp.where(ok_BW, at_BW + 1, NONE).astype(jnp.int32)
