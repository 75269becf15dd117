"""How a cache method speculates: the one value the generic decode loop (decode.py, runtime.py), the decoder's
row positions and the validation ask about it (`CacheConfig.speculation`).

  Speculation          the protocol: rows per decoding step, where they sit, which are stored, pre-decoding,
                       prompt lookup and its anchors, and `observe` (the loop's report after each step)
  NO_SPECULATION       every method but SpeCache: one row per step, nothing to observe
  SpeCacheSpeculation  SpeCache's speculation, one frozen hashable value (docs/speculation.md): the faithful
                       method (`FAITHFUL`, the default), the non-speculative ablation (`NON_SPECULATIVE`), the
                       ablation without pre-decoding (`NO_PREDECODE`), exact-on-miss (`EXACT_ON_MISS`) and the
                       robust combination (`robust(topk)`), or any other composition of its fields

SpeCache's module (caches/specache.py, selection.py, specache_attention.py) reads the fields; nothing else does.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax.numpy as jnp

from specache_jax.errors import ConfigError


class Speculation(Protocol):
  """What the decode loop knows of a method's speculation."""

  @property
  def width(self) -> int:
    """Query rows per decoding step: the real row and its speculative guesses (1: none)."""

  @property
  def predecodes(self) -> bool:
    """Whether the method's module has `predecode` (a pass over the first token before step 1)."""

  @property
  def lookup(self) -> int:
    """Prompt lookup (history.py): the longest suffix matched in the tokens so far; 0 = none."""

  @property
  def anchor_rows(self) -> int:
    """Positions around each next-input row's lookup match that the method fetches first; 0 = none."""

  @property
  def anchor_min_match(self) -> int:
    """The shortest repeat (tokens) that anchors a row (`anchor_rows`)."""

  @property
  def keeps_tokens(self) -> bool:
    """Whether the cache carries its tokens' ids (`Cache.tokens`; lookups read them)."""

  def row_offsets(self, t: int) -> tuple[int, ...]:
    """Positions of a decoding call's T new rows after the n stored tokens, as offsets from n. A new row sees
    the new rows at earlier positions and itself (`attention.new_rows_mask`)."""

  def rows_stored(self, t: int, phase: str) -> int:
    """How many of a call's T new rows enter the cache."""

  def observe(self, st, missed_B, anchors_BW=None):
    """Before the next step: which rows' guesses all missed [B] and where each row of the next input copies
    from [B, W] (`history.anchors`; either None: unchanged) -> the method's state (one layer's or stacked)."""


@dataclasses.dataclass(frozen=True)
class NoSpeculation:
  """One row per step at consecutive positions, all stored; nothing to observe."""
  width = 1
  predecodes = False
  lookup = 0
  anchor_rows = 0
  anchor_min_match = 1
  keeps_tokens = False

  def row_offsets(self, t: int) -> tuple[int, ...]:
    return tuple(range(t))

  def rows_stored(self, t: int, phase: str) -> int:
    return t

  def observe(self, st, missed_B, anchors_BW=None):
    del missed_B, anchors_BW
    return st


NO_SPECULATION = NoSpeculation()


def _check(name: str, value, kind: type, minimum: int = 0) -> None:
  if kind is bool and not isinstance(value, bool):
    raise ConfigError(f"{name}={value!r} must be a bool")
  if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


@dataclasses.dataclass(frozen=True)
class SpeCacheSpeculation:
  """SpeCache's speculation. The defaults are the paper's method: one speculative row (the greedy guess of the
  next token) whose low-bit attention picks κ_{t+1}; every other field is a project extension, off by default
  and composable (docs/speculation.md: what each does and measured)."""
  speculative: bool = True      # False: the ablation: κ_t from the real row's own low-bit attention, fetched
                                # on the critical path every step (no speculative row, no pre-decoding)
  predecode: bool = True        # False: the ablation without the pre-decoding pass: step 1 attends with no κ_1
                                # (every position below the ring low-bit) and its speculative rows repeat T1
                                # (a placeholder; κ_2 is their top-k); from step 2 on, unchanged
  candidates: int = 1           # speculative rows per step: the likeliest next tokens (the guesses of the row
                                # whose guess was right), all at n + 1; κ_{t+1}: top-k of their max probability
  exact_on_miss: bool = False   # when every guess of the step's real token was wrong, κ_t is the real row's own
                                # low-bit top-k, chosen and fetched on the critical path
  correct_with_fetched: bool = False  # that synchronous choice (exact_on_miss, non-speculative) scores the rows
                                # already on the device in 16-bit and the rest low-bit, not every row low-bit
  lowbit_in_output: bool = True  # False: a decoding step's output attends only κ_t, the ring and the new rows;
                                # the low-bit copy only scores (κ choices; the pre-decoding pass's T1)
  lookup: int = 0               # > 0: the token after the latest earlier occurrence of the last `lookup` tokens
                                # (or a shorter suffix) replaces the last guess (prompt lookup; history.py)
  lookup_rows: int = 0          # > 0 (needs lookup): up to this many of κ's rows, before any scored row, around
                                # where the rows that use κ copy from (`selection.anchored`)
  anchor_match: int = 3         # the shortest repeat (tokens; `lookup` if shorter) that anchors a row
  exact_ring: bool = False      # the ring's columns read its 16-bit keys at every slot (KIVI's rule, off: the
                                # last quantized window's slots read their low-bit keys); κ skips the whole ring
  skip_ring: bool = False       # κ's candidates exclude the positions the attend reads in 16-bit anyway (ring)

  def __post_init__(self):
    for name in ("speculative", "predecode", "exact_on_miss", "correct_with_fetched", "lowbit_in_output", "exact_ring",
                 "skip_ring"):
      _check(name, getattr(self, name), bool)
    _check("candidates", self.candidates, int, 1)
    _check("lookup", self.lookup, int, 0)
    _check("lookup_rows", self.lookup_rows, int, 0)
    _check("anchor_match", self.anchor_match, int, 1)
    if not self.predecode and not self.speculative:
      raise ConfigError(f"predecode={self.predecode} turns off the speculative method's pre-decoding pass; "
                        "speculative=False has none (leave predecode at True)")
    if self.candidates > 1 and not self.speculative:
      raise ConfigError(f"candidates={self.candidates} are speculative rows; they need speculative=True")
    if self.lookup and not self.speculative:
      raise ConfigError(f"lookup={self.lookup} adds a speculative guess; it needs speculative=True")
    if self.lookup_rows and not self.lookup:
      raise ConfigError(f"lookup_rows={self.lookup_rows} anchors κ where the tokens occurred before; it needs "
                        "lookup > 0 (the n-gram it matches)")
    if self.correct_with_fetched and not self.fetches_on_critical_path:
      raise ConfigError("correct_with_fetched=True acts on synchronous κ choices: it needs exact_on_miss=True "
                        "or speculative=False")

  @property
  def fetches_on_critical_path(self) -> bool:
    """Whether a step may choose (and so fetch) its own κ_t before attention: the non-speculative ablation
    always, exact_on_miss for the rows whose guesses all missed."""
    return (not self.speculative) or self.exact_on_miss

  @property
  def width(self) -> int:
    return 1 + self.candidates if self.speculative else 1

  @property
  def predecodes(self) -> bool:
    return self.speculative and self.predecode

  @property
  def anchor_rows(self) -> int:
    return self.lookup_rows

  @property
  def anchor_min_match(self) -> int:
    return min(self.anchor_match, self.lookup)

  @property
  def keeps_tokens(self) -> bool:
    return self.lookup > 0

  def row_offsets(self, t: int) -> tuple[int, ...]:
    """The real row at n, every speculative candidate at n + 1."""
    return (0,) + (1,) * (t - 1)

  def rows_stored(self, t: int, phase: str) -> int:
    return 1 if (phase == "decode" and self.speculative) else t

  def observe(self, st, missed_B, anchors_BW=None):
    """Record the rows whose guesses all missed (`st.miss`: exact_on_miss acts on it, track_hits splits its
    statistics by it) and, with lookup_rows, the next input's anchors (`st.anchor`)."""
    if missed_B is not None:
      st = st.replace(miss=jnp.broadcast_to(missed_B, st.miss.shape))
    if self.lookup_rows and anchors_BW is not None:
      st = st.replace(anchor=jnp.broadcast_to(anchors_BW, st.anchor.shape).astype(jnp.int32))
    return st


FAITHFUL = SpeCacheSpeculation()
NON_SPECULATIVE = SpeCacheSpeculation(speculative=False)
NO_PREDECODE = SpeCacheSpeculation(predecode=False)
EXACT_ON_MISS = SpeCacheSpeculation(exact_on_miss=True)


def robust(topk: int) -> SpeCacheSpeculation:
  """The robust combination for κ of `topk` rows: 3 candidates, exact-on-miss scored with the fetched rows, an
  output without low-bit values, prompt lookup of 3 tokens anchoring up to half of κ, the ring's 16-bit keys
  read and κ outside the ring (docs/speculation.md)."""
  return SpeCacheSpeculation(candidates=3, exact_on_miss=True, correct_with_fetched=True, lowbit_in_output=False,
                             lookup=3, lookup_rows=topk // 2, exact_ring=True, skip_ring=True)


FIELDS = tuple(f.name for f in dataclasses.fields(SpeCacheSpeculation))


def observe(method, layers, missed_B, anchors_BW=None):
  """`method.speculation.observe` over a stacked state or a per-layer tuple of states."""
  spec = method.speculation
  if isinstance(layers, (tuple, list)):
    return tuple(spec.observe(st, missed_B, anchors_BW) for st in layers)
  return spec.observe(layers, missed_B, anchors_BW)
