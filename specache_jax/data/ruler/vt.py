"""RULER's variable tracking (vt): a chain "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE ", ... hidden line by
line in the noise haystack; the model names every variable that ends up holding the value.

One worked example comes first (RULER's in-context example: the same task with 3-letter names and its answer,
the noise grown to `icl_tokens` tokens of the model's tokenizer); its names and value differ from the sample's.
"""
from __future__ import annotations

import dataclasses
import string

from specache_jax.data.ruler import haystacks, templates
from specache_jax.data.ruler.sample import Draft, TooShort, fill, fit, join_marked


@dataclasses.dataclass(frozen=True)
class Fixed:
  chains: tuple[tuple[str, ...], ...]   # per chain: its statements, in order
  names: tuple[str, ...]                # the first chain's variables (the answer)
  value: str
  example: str                          # the worked example, ending with "\n"


def _chains(rng, n_chains: int, n_hops: int, letters: int, avoid_values=()):
  names = haystacks.distinct(rng, lambda r: haystacks.letters(r, letters, string.ascii_uppercase),
                             n_chains * (n_hops + 1), avoid={"VAR"})
  chains = []
  for c in range(n_chains):
    var = names[c * (n_hops + 1):(c + 1) * (n_hops + 1)]
    while (value := str(rng.randint(10000, 99999))) in avoid_values:
      pass
    chains.append((f"VAR {var[0]} = {value}",) + tuple(f"VAR {var[j + 1]} = VAR {var[j]} " for j in range(n_hops)))
    if c == 0:
      first = (tuple(var), value)
  return tuple(chains), first[0], first[1]


def _layout(rng, chains, n_lines: int) -> tuple[str, list[tuple[str, int]]]:
  """Noise lines with each chain's statements inserted in order at random lines (RULER's list insertion)."""
  items = [(templates.NOISE, False)] * n_lines
  for chain in chains:
    at = sorted(rng.sample(range(len(items)), len(chain)))
    for j, (pos, statement) in enumerate(zip(at, chain)):
      items.insert(pos + j, (statement, True))
  return join_marked(items, "\n")


def _fill(context: str, value: str, n_vars: int) -> tuple[str, str, int]:
  user, c0 = fill(templates.VT, context, query=value)
  return user, templates.VT_PREFIX.format(num_v=n_vars, query=value), c0


@dataclasses.dataclass(frozen=True)
class VariableTracking:
  num_chains: int = 1
  num_hops: int = 4
  icl_tokens: int = 500                 # the worked example's size (RULER: 500 tokens)
  gen_tokens: int = 30
  metric: str = "all"
  step: int = 25                        # noise lines

  def __post_init__(self):
    if self.num_chains < 1 or self.num_hops < 1:
      raise ValueError(f"num_chains={self.num_chains} and num_hops={self.num_hops} must be >= 1")

  def min_size(self, fixed) -> int:
    return max(len(c) for c in fixed.chains)

  def max_size(self, coords, fixed):
    return None

  def prepare(self, coords, tokenizer, data_files) -> Fixed:
    del data_files
    rng = coords.rng()
    chains, names, value = _chains(rng, self.num_chains, self.num_hops, 5)
    icl_chains, icl_names, icl_value = _chains(coords.rng("example"), self.num_chains, min(10, self.num_hops), 3,
                                               avoid_values={c[0].rsplit(" ", 1)[-1] for c in chains})

    def example(n_lines: int) -> str:
      context, _ = _layout(coords.rng(f"example/{n_lines}"), icl_chains, n_lines)
      user, prefix, _ = _fill(context, icl_value, len(icl_names))
      return user + prefix

    lo = len(icl_chains[0])
    try:
      n_lines, _ = fit(example, lambda text: len(tokenizer.encode(text)), self.icl_tokens, lo=lo, step=5)
    except TooShort:                    # a tokenizer this coarse gets the smallest example
      n_lines = lo
    return Fixed(chains, names, value, example(n_lines) + " " + " ".join(icl_names) + "\n")

  def draft(self, coords, fixed: Fixed, size: int) -> Draft:
    context, marked = _layout(coords.rng(f"layout/{size}"), fixed.chains, size)
    body, prefix, c0 = _fill(context, fixed.value, len(fixed.names))
    head = fixed.example + "\n"
    return Draft(user=head + body, answer_prefix=prefix, answers=fixed.names, query=fixed.value,
                 context=(len(head) + c0, len(head) + c0 + len(context)),
                 needles=tuple((t, len(head) + c0 + off) for t, off in marked))
