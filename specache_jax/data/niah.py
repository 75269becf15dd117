"""Needle-in-a-Haystack cases, independent of any model.

A case hides one needle sentence in a haystack trimmed to a token budget, at a fractional depth, backed off
to the previous sentence boundary (a "." followed by whitespace, not after "Mr", "Mrs", an initial and a few
other abbreviations), as the original NIAH test does
(github.com/gkamradt/LLMTest_NeedleInAHaystack). The tokenizer is any object with
``encode(str) -> list[int]`` and ``decode(list[int]) -> str``; ``WhitespaceTokenizer`` and
``CharTokenizer`` are simple stand-ins for tests and model-free grids.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Iterator, NamedTuple, Protocol, Sequence

DEFAULT_NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
DEFAULT_QUESTION = "What is the best thing to do in San Francisco?"
MATCH_MODES = ("all", "any")
_SENTENCE_END = re.compile(r"\.\s+")  # the boundary is right after the whitespace
# A "." after these (or after a single capital, an initial) does not end a sentence ("Mr. Weston").
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "st", "jr", "sr", "messrs", "rev", "col", "capt", "vs",
                            "etc", "e.g", "i.e"})


class Tokenizer(Protocol):

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int]) -> str:
    ...


# (context, question) -> prompt text; the context must appear in the prompt verbatim.
Formatter = Callable[[str, str], str]


@dataclasses.dataclass(frozen=True)
class NeedleSpec:
  """The hidden fact, the question that asks for it, and how an answer is checked.

  ``match="all"``: every keyword must appear in the response; ``"any"``: one is enough (case-insensitive).
  """
  needle: str = DEFAULT_NEEDLE
  question: str = DEFAULT_QUESTION
  answer_keywords: tuple[str, ...] = ("sandwich", "Dolores Park")
  match: str = "all"

  def __post_init__(self):
    if not self.needle.strip():
      raise ValueError(f"needle={self.needle!r} must not be blank")
    if not self.question.strip():
      raise ValueError(f"question={self.question!r} must not be blank")
    if not isinstance(self.answer_keywords, tuple) or not self.answer_keywords:
      raise ValueError(f"answer_keywords={self.answer_keywords!r} must be a non-empty tuple of strings")
    if any(not isinstance(k, str) or not k.strip() for k in self.answer_keywords):
      raise ValueError(f"answer_keywords={self.answer_keywords!r} must all be non-blank strings")
    if self.match not in MATCH_MODES:
      raise ValueError(f"match={self.match!r} must be one of {MATCH_MODES}")


# More needles for a grid of several questions (`--config.more_needles` of experiments.niah): facts that cannot
# be guessed from the haystack or from general knowledge, each checked by a keyword the answer must name.
NEEDLE_SET = {
    "lighthouse": NeedleSpec(
        needle="The password for the old lighthouse on Gull Island is violet harbor.",
        question="What is the password for the old lighthouse on Gull Island?",
        answer_keywords=("violet harbor",)),
    "soup": NeedleSpec(
        needle="The secret ingredient in Grandma Odile's winter soup is smoked paprika.",
        question="What is the secret ingredient in Grandma Odile's winter soup?",
        answer_keywords=("paprika",)),
    "train": NeedleSpec(
        needle="The night train to Kessrow leaves from platform nineteen.",
        question="From which platform does the night train to Kessrow leave?",
        answer_keywords=("nineteen", "19"), match="any"),
}


def needle_set(names: str) -> dict[str, NeedleSpec]:
  """"lighthouse,soup" -> those entries of NEEDLE_SET, in order ("" -> none)."""
  keys = [k.strip() for k in str(names).split(",") if k.strip()]
  unknown = [k for k in keys if k not in NEEDLE_SET]
  if unknown or len(set(keys)) != len(keys):
    raise ValueError(f"needles {names!r}: each must be one of {sorted(NEEDLE_SET)}, none repeated")
  return {k: NEEDLE_SET[k] for k in keys}


@dataclasses.dataclass(frozen=True)
class NiahCase:
  """One built case. ``prompt_ids[needle_start:needle_end]`` is the shortest token span whose decoding
  contains the needle. ``depth`` is the one used: haystack tokens before the needle / haystack tokens."""
  context: str                   # haystack with the needle inserted
  prompt: str                    # formatter(context, question)
  prompt_ids: tuple[int, ...]    # tokenizer.encode(prompt)
  needle_start: int
  needle_end: int
  depth: float                   # used, after the sentence-boundary backoff
  requested_depth: float
  context_tokens: int            # the requested budget
  haystack_tokens: int           # haystack tokens kept (without the needle)
  spec: NeedleSpec

  @property
  def needle_span(self) -> tuple[int, int]:
    return self.needle_start, self.needle_end


def plain_prompt(context: str, question: str) -> str:
  """The context, then the question, then "Answer:" for a base model to complete."""
  return f"{context}\n\nQuestion: {question}\nAnswer:"


def chatml_prompt(context: str, question: str) -> str:
  """The plain prompt as one user turn in ChatML (SmolLM2-Instruct, Qwen2), ready for the assistant.
  The tokenizer must map ``<|im_start|>``/``<|im_end|>`` to its special tokens."""
  user = f"{context}\n\nQuestion: {question} Answer briefly from the text above."
  return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def build_case(tokenizer: Tokenizer, haystack_text: str, needle: NeedleSpec, context_tokens: int,
               depth: float, *, formatter: Formatter = plain_prompt, reserve_tokens: int = 0) -> NiahCase:
  """A prompt of about ``context_tokens - reserve_tokens`` tokens with the needle at fractional ``depth``.

  The haystack keeps ``context_tokens - reserve_tokens - needle tokens - prompt overhead`` tokens (the
  overhead is measured as ``formatter("", question)``); ``reserve_tokens`` leaves room, e.g. for the answer.
  Token counts of the pieces may differ from the whole by a few tokens where merges cross a boundary.
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"{depth=} must be in [0, 1]")
  if reserve_tokens < 0:
    raise ValueError(f"{reserve_tokens=} must be >= 0")
  needle_len = len(tokenizer.encode(needle.needle + " "))  # with the space that follows it
  overhead = len(tokenizer.encode(formatter("", needle.question)))
  budget = context_tokens - reserve_tokens - needle_len - overhead
  if budget <= 0:
    raise ValueError(f"{context_tokens=} is too short for the needle: {reserve_tokens=}, needle "
                     f"{needle_len} tokens and prompt {overhead} tokens leave {budget} haystack tokens")
  haystack_ids = _encode_prefix(tokenizer, haystack_text, budget)
  if len(haystack_ids) < budget:
    raise ValueError(f"the haystack has {len(haystack_ids)} tokens, fewer than the {budget} needed for "
                     f"{context_tokens=}; use a longer haystack")
  haystack_ids = haystack_ids[:budget]
  haystack = tokenizer.decode(haystack_ids)

  target = len(tokenizer.decode(haystack_ids[:round(depth * budget)]))
  cut = _sentence_boundary(haystack, target)
  before, after = haystack[:cut], haystack[cut:]
  if cut == len(haystack):
    before = f"{before.rstrip()} " if before.strip() else ""
    context = before + needle.needle
  elif cut == 0:
    context = f"{needle.needle} {after.lstrip()}"
  else:
    context = f"{before}{needle.needle} {after}"
  needle_at = len(before)  # char offset of the needle in the context
  used = min(len(tokenizer.encode(before)), budget) / budget if before.strip() else 0.0

  prompt = formatter(context, needle.question)
  if context not in prompt:
    raise ValueError(f"formatter {formatter!r} must include the context verbatim in the prompt")
  prompt_ids = list(tokenizer.encode(prompt))
  start, end = _needle_token_span(tokenizer, prompt, prompt_ids, needle.needle,
                                  prompt.index(context) + needle_at)
  return NiahCase(context=context, prompt=prompt, prompt_ids=tuple(prompt_ids), needle_start=start,
                  needle_end=end, depth=used, requested_depth=float(depth), context_tokens=context_tokens,
                  haystack_tokens=budget, spec=needle)


def score(response: str, spec: NeedleSpec) -> bool:
  """Whether the response names the answer keywords (all or any of them, per ``spec.match``)."""
  text = " ".join(response.lower().split())
  hits = [" ".join(k.lower().split()) in text for k in spec.answer_keywords]
  return all(hits) if spec.match == "all" else any(hits)


class GridCell(NamedTuple):
  id: str
  context_length: int
  depth: float


def cell_id(context_length: int, depth: float) -> str:
  """Stable id, e.g. "len=1024_depth=0.50" (more digits only when two decimals would round)."""
  digits = f"{depth:.2f}"
  if float(digits) != depth:
    digits = f"{depth:.6f}".rstrip("0")
  return f"len={context_length}_depth={digits}"


def grid(context_lengths: Iterable[int], depths: Iterable[float]) -> Iterator[GridCell]:
  """Every (length, depth) cell, lengths outer, in the given orders."""
  context_lengths, depths = list(context_lengths), [float(d) for d in depths]
  for n in context_lengths:
    if not isinstance(n, int) or n <= 0:
      raise ValueError(f"context length {n!r} must be a positive int")
  for d in depths:
    if not 0.0 <= d <= 1.0:
      raise ValueError(f"depth={d} must be in [0, 1]")
  if len(set(context_lengths)) != len(context_lengths) or len(set(depths)) != len(depths):
    raise ValueError(f"{context_lengths=} and {depths=} must not repeat values")
  for n in context_lengths:
    for d in depths:
      yield GridCell(cell_id(n, d), n, d)


def _encode_prefix(tokenizer: Tokenizer, text: str, n_tokens: int) -> list[int]:
  """At least ``n_tokens + 1`` tokens from the start of ``text`` (or all of it), encoding a growing
  prefix so that a long haystack is not encoded whole; the extra token absorbs a word cut at the end."""
  chars = 8 * (n_tokens + 1)
  while True:
    ids = list(tokenizer.encode(text[:chars]))
    if chars >= len(text) or len(ids) > n_tokens + 1:
      return ids
    chars *= 2


def _sentence_boundary(text: str, pos: int) -> int:
  """The last sentence start at or before ``pos`` (0 when none; ``len(text)`` when ``pos`` is the end)."""
  if pos >= len(text.rstrip()):
    return len(text)
  best = 0
  for m in _SENTENCE_END.finditer(text, 0, pos):
    word = text[max(0, m.start() - 8):m.start()].split()
    word = word[-1] if word else ""
    if word.lower() in _ABBREVIATIONS or (len(word) == 1 and word.isupper()):
      continue
    best = m.end()
  return best


def _needle_token_span(tokenizer: Tokenizer, prompt: str, prompt_ids: list[int], needle: str,
                       char_start: int) -> tuple[int, int]:
  """Shortest [start, end) with ``needle in decode(prompt_ids[start:end])``, searched near the token
  counts of the text before and through the needle."""
  start = len(tokenizer.encode(prompt[:char_start]))
  end = len(tokenizer.encode(prompt[:char_start + len(needle)]))
  for slack in (2, 8, 32, len(prompt_ids)):
    lo, hi = max(0, start - slack), min(len(prompt_ids), end + slack)
    if needle in tokenizer.decode(prompt_ids[lo:hi]):
      break
  else:
    raise ValueError("the needle is not found in the decoded prompt; the tokenizer does not round-trip it")
  while lo + 1 < hi and needle in tokenizer.decode(prompt_ids[lo + 1:hi]):
    lo += 1
  while hi - 1 > lo and needle in tokenizer.decode(prompt_ids[lo:hi - 1]):
    hi -= 1
  return lo, hi


class WhitespaceTokenizer:
  """One token per whitespace-separated word; ``decode`` joins words with single spaces (newlines and
  repeated spaces are not kept). Ids come from a vocabulary that grows as new words are seen, so they are
  only comparable within one instance."""

  def __init__(self):
    self._ids: dict[str, int] = {}
    self._words: list[str] = []

  def encode(self, text: str) -> list[int]:
    out = []
    for word in text.split():
      if word not in self._ids:
        self._ids[word] = len(self._words)
        self._words.append(word)
      out.append(self._ids[word])
    return out

  def decode(self, ids: Sequence[int]) -> str:
    return " ".join(self._words[i] for i in ids)


class CharTokenizer:
  """One token per Unicode character (id = code point); exact round trip."""

  def encode(self, text: str) -> list[int]:
    return [ord(c) for c in text]

  def decode(self, ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)
