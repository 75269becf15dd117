"""A RULER sample, its prompt, and the search that fits it to a token budget.

A task builds a `Draft` (the user turn, the answer prefix, the references, where the needles are) for a given
haystack size, drawing every random choice from a generator seeded by (task, length, index, seed), so a draft
is a function of its size alone. `fit` searches the largest size whose prompt, in the model's own tokens, plus
the task's generation budget fits the length (RULER's binary search over the haystack size).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Protocol, Sequence

METRICS = ("all", "part")     # string_match_all, string_match_part


class Tokenizer(Protocol):

  def encode(self, text: str) -> list[int]:
    ...


# The user turn -> the model's input up to where the answer starts (a chat template with its assistant header,
# or the text itself for a base model); the answer prefix is appended after it.
Formatter = Callable[[str], str]


def plain(user: str) -> str:
  """RULER's "base" template: the task text as it is."""
  return user


def chat(tokenizer) -> Formatter:
  """The model's chat template: one user turn, then the assistant header (`tokenizer.chat`)."""
  return lambda user: tokenizer.chat([{"role": "user", "content": user}])


@dataclasses.dataclass(frozen=True)
class Draft:
  user: str                             # the task template, filled in (the user turn)
  answer_prefix: str                    # continued by the model
  answers: tuple[str, ...]              # references
  query: str
  context: tuple[int, int]              # [start, end) of the haystack (with its needles) in `user`
  needles: tuple[tuple[str, int], ...]  # (text, char offset in `user`) of each inserted item, in text order


@dataclasses.dataclass(frozen=True)
class Needle:
  text: str
  start: int                            # char offset in the prompt: prompt[start:start + len(text)] == text
  depth: float                          # haystack chars before it / haystack chars, in [0, 1]


@dataclasses.dataclass(frozen=True)
class Sample:
  task: str
  index: int
  length: int                           # the budget: len(prompt_ids) + gen_tokens <= length
  seed: int
  prompt: str                           # formatter(user) + answer_prefix: the model's whole input
  prompt_ids: tuple[int, ...]
  answers: tuple[str, ...]
  answer_prefix: str
  query: str
  gen_tokens: int                       # the task's generation budget
  metric: str                           # "all" | "part"
  size: int                             # haystack size found by the search (the task's own unit)
  context: tuple[int, int]              # [start, end) of the haystack in the prompt
  needles: tuple[Needle, ...]

  @property
  def id(self) -> str:
    return sample_id(self.task, self.length, self.index)


def sample_id(task: str, length: int, index: int) -> str:
  """E.g. "niah_single_1/len=4096/i=3"."""
  return f"{task}/len={length}/i={index}"


def rng_for(task: str, length: int, index: int, seed: int, part: str = "") -> random.Random:
  """A generator seeded by the sample's coordinates (string seeds hash the same in every process)."""
  return random.Random(f"ruler/{task}/{length}/{index}/{seed}/{part}")


def assemble(draft: Draft, formatter: Formatter) -> tuple[str, int]:
  """(prompt, offset of the user turn in it)."""
  head = formatter(draft.user)
  at = head.find(draft.user)
  if at < 0:
    raise ValueError("the formatter must include the user turn verbatim in the prompt")
  return head + draft.answer_prefix, at


class TooShort(ValueError):
  pass


def fit(make: Callable[[int], Draft], count: Callable[[Draft], int], budget: int, lo: int, step: int,
        hi_cap: int | None = None) -> tuple[int, Draft]:
  """The largest size in [lo, hi_cap] whose draft has `count(draft) <= budget`, assuming counts grow with
  the size: a bracket by linear extrapolation, then interpolation (bisection when one side keeps moving)."""
  memo: dict[int, tuple[int, Draft]] = {}

  def probe(size: int) -> int:
    if size not in memo:
      d = make(size)
      memo[size] = (count(d), d)
    return memo[size][0]

  c_lo = probe(lo)
  if c_lo > budget:
    raise TooShort(f"the smallest haystack ({lo} units) already needs {c_lo} tokens, over the budget of {budget}")
  hi = lo + max(1, step)
  while hi_cap is None or lo < hi_cap:
    if hi_cap is not None:
      hi = min(hi, hi_cap)
    c_hi = probe(hi)
    if c_hi > budget:
      break
    slope = max((c_hi - c_lo) / (hi - lo), 1e-3)
    lo, c_lo = hi, c_hi
    hi = lo + max(1, int((budget - c_lo) / slope * 1.05) + 1, (hi - lo) // 8)
  else:
    return lo, memo[lo][1]
  last = None
  while hi - lo > 1:
    if last is not None and last[0] == last[1]:       # the same side moved twice: bisect
      mid = (lo + hi) // 2
    else:
      mid = lo + int((budget - c_lo) / max(c_hi - c_lo, 1) * (hi - lo))
    mid = min(max(mid, lo + 1), hi - 1)
    c = probe(mid)
    side = c <= budget
    if side:
      lo, c_lo = mid, c
    else:
      hi, c_hi = mid, c
    last = (side, last[0] if last else None)
  return lo, memo[lo][1]


def finish(draft: Draft, formatter: Formatter, tokenizer: Tokenizer, *, task: str, index: int, length: int,
           seed: int, gen_tokens: int, metric: str, size: int) -> Sample:
  prompt, at = assemble(draft, formatter)
  c0, c1 = draft.context
  span = max(c1 - c0, 1)
  needles = tuple(Needle(text, at + off, (off - c0) / span) for text, off in draft.needles)
  return Sample(task=task, index=index, length=length, seed=seed, prompt=prompt,
                prompt_ids=tuple(tokenizer.encode(prompt)), answers=draft.answers,
                answer_prefix=draft.answer_prefix, query=draft.query, gen_tokens=gen_tokens, metric=metric,
                size=size, context=(at + c0, at + c1), needles=needles)


def join_marked(items: Sequence[tuple[str, bool]], sep: str) -> tuple[str, list[tuple[str, int]]]:
  """Pieces joined by `sep`; returns the text and (piece, char offset) of the pieces marked True, in order."""
  marked, pos = [], 0
  for k, (text, is_needle) in enumerate(items):
    if k:
      pos += len(sep)
    if is_needle:
      marked.append((text, pos))
    pos += len(text)
  return sep.join(t for t, _ in items), marked


def fill(template: str, context: str, **fields) -> tuple[str, int]:
  """`template` with `{context}` and the other fields filled in, and where the context starts."""
  head, tail = template.split("{context}")
  head = head.format(**fields)
  return head + context + tail.format(**fields), len(head)
