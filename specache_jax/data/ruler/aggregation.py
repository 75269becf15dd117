"""RULER's aggregation tasks: common words (cwe) and frequent coded words (fwe).

- cwe: a numbered list of words, 10 common words repeated `freq_cw` times and the rest `freq_ucw` times each
  (30 vs 3 at lengths >= 4096, 6 vs 1 below, as RULER), shuffled; one worked example first (40 words,
  10 vs 3; below 4096: 20 words, 3 vs 1). Words come from the wonderwords lists; the example's words are not
  the sample's (RULER draws them independently).
- fwe: `(length - gen_tokens) // 50` random 6-letter coded words, ranked at random; the word of rank k appears
  int(N k^-alpha / zeta(alpha)) times (Zipf, alpha = 2); rank 1 is replaced by "..." (noise) and the answer is
  ranks 2-4.
"""
from __future__ import annotations

import dataclasses
import math
import string

from specache_jax.data.ruler import haystacks, templates
from specache_jax.data.ruler.sample import Draft, fill


def zeta(alpha: float, terms: int = 1000) -> float:
  """Riemann zeta(alpha) for alpha > 1: a partial sum plus its Euler-Maclaurin tail."""
  if alpha <= 1:
    raise ValueError(f"{alpha=} must be > 1 (the zeta series diverges otherwise)")
  head = math.fsum(k ** -alpha for k in range(1, terms))
  n = float(terms)
  return head + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2 + alpha * n ** (-alpha - 1) / 12


def _numbered(words) -> str:
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


@dataclasses.dataclass(frozen=True)
class CommonWords:
  freq_cw: int = 30
  freq_ucw: int = 3
  num_cw: int = 10
  short_below: int = 4096               # RULER's smaller counts below this length
  gen_tokens: int = 120
  metric: str = "all"
  step: int = 10                        # distinct words

  def counts(self, length: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((example words, common reps, uncommon reps), (-, common reps, uncommon reps)) for a length."""
    if length < self.short_below:
      return (20, 3, 1), (0, 6, 1)
    return (40, 10, 3), (0, self.freq_cw, self.freq_ucw)

  def min_size(self, fixed) -> int:
    return self.num_cw + 1

  def max_size(self, coords, fixed) -> int:
    return len(fixed) - self.counts(coords.length)[0][0]   # the pool, less the example's words

  def prepare(self, coords, tokenizer, data_files):
    del tokenizer, data_files
    pool = list(haystacks.common_word_pool())
    coords.rng().shuffle(pool)
    return tuple(pool)                  # example words first, then the sample's

  def _list(self, rng, words, common_reps: int, uncommon_reps: int) -> tuple[str, tuple[str, ...]]:
    common, uncommon = words[:self.num_cw], words[self.num_cw:]
    items = list(common) * common_reps + list(uncommon) * uncommon_reps
    rng.shuffle(items)
    return _numbered(items), tuple(common)

  def draft(self, coords, fixed, size: int) -> Draft:
    (n_ex, ex_c, ex_u), (_, c, u) = self.counts(coords.length)
    if size + n_ex > len(fixed):
      raise ValueError(f"cwe at length {coords.length} asks for {size} words; the wonderwords pool has "
                       f"{len(fixed) - n_ex}")
    rng = coords.rng(f"layout/{size}")
    ex_context, ex_answer = self._list(rng, fixed[:n_ex], ex_c, ex_u)
    context, answer = self._list(rng, fixed[n_ex:n_ex + size], c, u)
    ex_user, _ = fill(templates.CWE, ex_context)
    head = ex_user + templates.CWE_PREFIX + " " + _numbered(ex_answer) + "\n"
    user, c0 = fill(templates.CWE, context)
    return Draft(user=head + user, answer_prefix=templates.CWE_PREFIX, answers=answer, query="",
                 context=(len(head) + c0, len(head) + c0 + len(context)), needles=())


@dataclasses.dataclass(frozen=True)
class FrequentWords:
  alpha: float = 2.0
  word_len: int = 6
  words_per_vocab: int = 50             # vocabulary = (length - gen_tokens) // this
  gen_tokens: int = 50
  metric: str = "all"
  step: int = 64                        # N, the Zipf scale (about the number of words)

  def min_size(self, fixed) -> int:
    return 16

  def max_size(self, coords, fixed):
    return None

  def counts(self, size: int, vocab: int) -> list[int]:
    z = zeta(self.alpha)
    return [int(size * k ** -self.alpha / z) for k in range(1, vocab + 1)]

  def prepare(self, coords, tokenizer, data_files) -> tuple[str, ...]:
    del tokenizer, data_files
    n = max(4, (coords.length - self.gen_tokens) // self.words_per_vocab)
    rng = coords.rng()
    vocab = haystacks.distinct(rng, lambda r: haystacks.letters(r, self.word_len, string.ascii_lowercase), n)
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    return ("...",) + tuple(vocab[1:])

  def draft(self, coords, fixed, size: int) -> Draft:
    words = [w for w, n in zip(fixed, self.counts(size, len(fixed))) for _ in range(n)]
    coords.rng(f"layout/{size}").shuffle(words)
    context = " ".join(words)
    user, c0 = fill(templates.FWE, context)
    return Draft(user=user, answer_prefix=templates.FWE_PREFIX, answers=tuple(fixed[1:4]), query="",
                 context=(c0, c0 + len(context)), needles=())
