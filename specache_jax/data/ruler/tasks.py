"""The 13 RULER tasks (RULER's `synthetic.yaml`) and `generate`, which builds one sample of one of them.

A task object has `prepare(coords, tokenizer, data_files)` (the draws made once per sample: keys, values,
chains, word lists, the question) and `draft(coords, fixed, size)` (the user turn for a haystack of `size`
units); `generate` searches the size so that the prompt, in the model's tokens, plus the task's generation
budget fits the length.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Mapping

from specache_jax.data.ruler import sample as sample_lib
from specache_jax.data.ruler.aggregation import CommonWords, FrequentWords
from specache_jax.data.ruler.niah import Niah
from specache_jax.data.ruler.qa import QA
from specache_jax.data.ruler.sample import Formatter, Sample, plain
from specache_jax.data.ruler.vt import VariableTracking

TASKS = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": Niah("essay", "words", "numbers", num_q=4),
    "vt": VariableTracking(num_chains=1, num_hops=4),
    "cwe": CommonWords(freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": FrequentWords(alpha=2.0),
    "qa_1": QA("squad"),
    "qa_2": QA("hotpotqa"),
}
# Column names of the results table (the RULER paper's abbreviations).
SHORT = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3", "niah_multikey_1": "MK1",
         "niah_multikey_2": "MK2", "niah_multikey_3": "MK3", "niah_multivalue": "MV", "niah_multiquery": "MQ",
         "vt": "VT", "cwe": "CWE", "fwe": "FWE", "qa_1": "QA1", "qa_2": "QA2"}
SYNTHETIC = tuple(t for t in TASKS if not t.startswith("qa_"))   # the 11 that need no data files


@dataclasses.dataclass(frozen=True)
class Coords:
  """What a sample is a function of (with the tokenizer and the prompt format)."""
  task: str
  length: int
  index: int
  seed: int

  def rng(self, part: str = "") -> random.Random:
    return sample_lib.rng_for(self.task, self.length, self.index, self.seed, part)


def check_task(task: str) -> None:
  if task not in TASKS:
    raise ValueError(f"task={task!r} is not a RULER task; expected one of {list(TASKS)}")


def gen_tokens(task: str) -> int:
  check_task(task)
  return TASKS[task].gen_tokens


def generate(task: str, length: int, index: int, seed: int, tokenizer, *, formatter: Formatter = plain,
             data_files: Mapping[str, str] | None = None) -> Sample:
  """Sample `index` of `task` at `length` tokens: the largest haystack with len(prompt_ids) + the task's
  generation budget <= length. `formatter` wraps the user turn (`sample.chat(tokenizer)` for the model's chat
  template; default RULER's plain "base" template); the answer prefix follows it. `data_files` maps
  "squad" / "hotpotqa" to the official JSON files (qa_1, qa_2)."""
  check_task(task)
  if not isinstance(length, int) or length <= 0:
    raise ValueError(f"{length=} must be a positive int")
  if index < 0:
    raise ValueError(f"{index=} must be >= 0")
  spec = TASKS[task]
  coords = Coords(task, length, index, seed)
  fixed = spec.prepare(coords, tokenizer, data_files)
  budget = length - spec.gen_tokens
  cap = spec.max_size(coords, fixed)

  def count(draft) -> int:
    return len(tokenizer.encode(sample_lib.assemble(draft, formatter)[0]))

  try:
    size, draft = sample_lib.fit(lambda n: spec.draft(coords, fixed, n), count, budget,
                                 lo=spec.min_size(fixed), step=spec.step, hi_cap=cap)
  except sample_lib.TooShort as e:
    raise ValueError(f"{task} does not fit {length=} tokens with its {spec.gen_tokens} generation tokens: "
                     f"{e}") from None
  if cap is not None and size == cap and count(spec.draft(coords, fixed, size)) < 0.95 * budget:
    raise ValueError(f"{task} at {length=} needs more haystack than there is ({cap} units fill "
                     f"{count(draft)} of {budget} tokens)")
  return sample_lib.finish(draft, formatter, tokenizer, task=task, index=index, length=length, seed=seed,
                           gen_tokens=spec.gen_tokens, metric=spec.metric, size=size)
