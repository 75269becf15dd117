"""RULER's needle-in-a-haystack family (8 tasks): keys and values hidden as "One of the special magic {type_v}
for {key} is: {value}." in a noise, essay or distractor-needle haystack.

- noise: RULER's five-sentence paragraph, one copy per line; the needles go between lines.
- essay: the first N essay words cut into sentences; each needle goes at a sentence boundary at a depth drawn
  (without replacement) from 40 depths spread evenly over 0..100% of the sentences, as RULER does.
- needle: N distractor needles (fresh keys and values of the same kinds), one per line.
Keys and values are drawn once per sample; they never occur in the haystack (essay keys and values are
checked against the whole essay text, distractors are redrawn when they repeat a real key or value).
"""
from __future__ import annotations

import dataclasses
import functools
import random

from specache_jax.data.ruler import haystacks, templates
from specache_jax.data.ruler.sample import Draft, fill, join_marked

HAYSTACKS = ("noise", "essay", "needle")
# RULER's depths: 40 evenly spaced percentages, rounded (np.round(np.linspace(0, 100, 40))).
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


@functools.cache
def _essay_text() -> str:
  return " ".join(haystacks.essay_words())


@dataclasses.dataclass(frozen=True)
class Fixed:
  """What a sample draws once, whatever the haystack size."""
  needles: tuple[str, ...]      # in the order they are placed
  keys: tuple[str, ...]
  values: tuple[str, ...]       # every key's values, flattened
  query: str
  answers: tuple[str, ...]
  depths: tuple[int, ...]       # essay: one percentage per needle (unsorted, as drawn)


@dataclasses.dataclass(frozen=True)
class Niah:
  haystack: str                 # noise | essay | needle
  type_k: str = "words"         # words | numbers | uuids
  type_v: str = "numbers"
  num_k: int = 1                # keys hidden
  num_v: int = 1                # values per key
  num_q: int = 1                # keys asked (<= num_k after RULER's max(num_k, num_q))
  gen_tokens: int = 128
  metric: str = "all"

  def __post_init__(self):
    if self.haystack not in HAYSTACKS:
      raise ValueError(f"haystack={self.haystack!r} must be one of {HAYSTACKS}")
    for kind in (self.type_k, self.type_v):
      if kind not in haystacks.DRAWS:
        raise ValueError(f"needle kind {kind!r} must be one of {sorted(haystacks.DRAWS)}")
    if min(self.num_k, self.num_v, self.num_q) < 1:
      raise ValueError(f"num_k={self.num_k}, num_v={self.num_v}, num_q={self.num_q} must all be >= 1")

  @property
  def n_needles(self) -> int:
    return max(self.num_k, self.num_q) * self.num_v

  @property
  def step(self) -> int:        # RULER's search increment: essay words or haystack lines
    return 500 if self.haystack == "essay" else 25

  def min_size(self, fixed) -> int:
    return 1 if self.haystack != "noise" else self.n_needles

  def max_size(self, coords, fixed):
    return None

  def prepare(self, coords, tokenizer, data_files) -> Fixed:
    del tokenizer, data_files
    rng = coords.rng()
    num_k = max(self.num_k, self.num_q)
    text = _essay_text() if self.haystack == "essay" else templates.NOISE

    def fresh(kind):
      return lambda r: _unseen(r, kind, text)

    keys = haystacks.distinct(rng, fresh(self.type_k), num_k)
    values = haystacks.distinct(rng, fresh(self.type_v), num_k * self.num_v)
    per_key = [values[i * self.num_v:(i + 1) * self.num_v] for i in range(num_k)]
    needles = [templates.NEEDLE.format(type_v=self.type_v, key=k, value=v) for k, vs in zip(keys, per_key)
               for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), self.num_q)
    queries = [keys[i] for i in asked]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    depths = tuple(rng.sample(DEPTHS, len(needles))) if self.haystack == "essay" else ()
    return Fixed(tuple(needles), tuple(keys), tuple(values), query,
                 tuple(v for i in asked for v in per_key[i]), depths)

  def draft(self, coords, fixed: Fixed, size: int) -> Draft:
    rng = coords.rng(f"layout/{size}")
    if self.haystack == "essay":
      sents = haystacks.split_sentences(haystacks.essay_prefix(size))
      at = sorted(int(len(sents) * d / 100) for d in fixed.depths)
      items, prev = [], 0
      for pos, needle in zip(at, fixed.needles):
        items += [(s, False) for s in sents[prev:pos]] + [(needle, True)]
        prev = pos
      items += [(s, False) for s in sents[prev:]]
      context, marked = join_marked(items, " ")
    else:
      if self.haystack == "noise":
        lines = [templates.NOISE] * size
      else:
        avoid_k, avoid_v = set(fixed.keys), set(fixed.values)
        lines = [templates.NEEDLE.format(type_v=self.type_v, key=_draw_not_in(rng, self.type_k, avoid_k),
                                         value=_draw_not_in(rng, self.type_v, avoid_v)) for _ in range(size)]
      at = sorted(rng.sample(range(size), len(fixed.needles)))
      items, prev = [], 0
      for pos, needle in zip(at, fixed.needles):
        items += [(s, False) for s in lines[prev:pos]] + [(needle, True)]
        prev = pos
      items += [(s, False) for s in lines[prev:]]
      context, marked = join_marked(items, "\n")
    singular = self.num_q * self.num_v == 1
    type_v = self.type_v[:-1] if singular else self.type_v
    template, prefix = ((templates.NIAH_SINGULAR, templates.NIAH_SINGULAR_PREFIX) if singular
                        else (templates.NIAH, templates.NIAH_PREFIX))
    user, c0 = fill(template, context, type_v=type_v, query=fixed.query)
    return Draft(user=user, answer_prefix=prefix.format(type_v=type_v, query=fixed.query), answers=fixed.answers,
                 query=fixed.query, context=(c0, c0 + len(context)),
                 needles=tuple((t, c0 + off) for t, off in marked))


def _unseen(rng: random.Random, kind: str, text: str) -> str:
  while True:
    v = haystacks.draw(kind, rng)
    if v not in text:
      return v


def _draw_not_in(rng: random.Random, kind: str, avoid: set) -> str:
  while True:
    v = haystacks.draw(kind, rng)
    if v not in avoid:
      return v
