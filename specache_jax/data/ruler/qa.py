"""RULER's QA tasks: a question whose gold paragraph(s) sit among distractor documents.

- qa_1: SQuAD v2.0 dev (`dev-v2.0.json`, https://rajpurkar.github.io/SQuAD-explorer/); answerable questions only,
  distractors first from the same article's other paragraphs, then from any article.
- qa_2: HotpotQA dev, distractor setting (`hotpot_dev_distractor_v1.json`, https://hotpotqa.github.io/); a
  question's 10 paragraphs (2 gold + 8 distractors) first, then paragraphs of other questions.
Documents are the distinct paragraphs of the file, sorted; sample `index` asks question `index` in file order
(RULER's order); the documents are shuffled and written "Document {i}:\\n{text}", separated by a blank line.
Nothing is downloaded: the files are read from the paths the user gives.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

from specache_jax.data.ruler import templates
from specache_jax.data.ruler.sample import Draft, fill, join_marked

DATASETS = {
    "squad": ("SQuAD v2.0 dev", "dev-v2.0.json", "https://rajpurkar.github.io/SQuAD-explorer/"),
    "hotpotqa": ("HotpotQA dev (distractor)", "hotpot_dev_distractor_v1.json", "https://hotpotqa.github.io/"),
}


@dataclasses.dataclass(frozen=True)
class Question:
  query: str
  answers: tuple[str, ...]
  gold: tuple[int, ...]         # document ids that hold the answer (qa_2: all of the question's paragraphs)
  more: tuple[int, ...]         # qa_1: the article's other paragraphs (preferred distractors)


@dataclasses.dataclass(frozen=True)
class QaData:
  questions: tuple[Question, ...]
  docs: tuple[str, ...]


def data_path(dataset: str, data_files) -> str:
  """The file for `dataset`, with an error naming the missing file and where to get it."""
  name, filename, url = DATASETS[dataset]
  path = (data_files or {}).get(dataset, "")
  if not path:
    raise FileNotFoundError(f"RULER's {dataset} task reads the official {name} JSON ({filename}, from {url}); "
                            f"no path was given for {dataset!r} (set it, e.g. --config.{dataset}={filename})")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist; RULER's {dataset} task reads the official {name} JSON "
                            f"({filename}, from {url})")
  return path


@functools.cache
def read_squad(path: str) -> QaData:
  data = _load(path, "squad")
  if not isinstance(data, dict) or not isinstance(data.get("data"), list):
    raise ValueError(f"{path} is not SQuAD JSON: expected an object with a 'data' list of articles")
  docs = sorted({p["context"] for art in data["data"] for p in art["paragraphs"]})
  doc_id = {d: i for i, d in enumerate(docs)}
  out = []
  for art in data["data"]:
    article = [doc_id[p["context"]] for p in art["paragraphs"]]
    for p in art["paragraphs"]:
      me = doc_id[p["context"]]
      for qa in p["qas"]:
        if not qa.get("is_impossible", False):
          out.append(Question(qa["question"], tuple(a["text"] for a in qa["answers"]), (me,),
                              tuple(i for i in article if i != me)))
  return QaData(tuple(out), tuple(docs))


@functools.cache
def read_hotpotqa(path: str) -> QaData:
  data = _load(path, "hotpotqa")
  if not isinstance(data, list) or not all(isinstance(d, dict) and "context" in d for d in data):
    raise ValueError(f"{path} is not HotpotQA JSON: expected a list of questions with 'context' paragraphs")

  def doc(title, sentences):
    return f"{title}\n{''.join(sentences)}"

  docs = sorted({doc(t, s) for d in data for t, s in d["context"]})
  doc_id = {d: i for i, d in enumerate(docs)}
  return QaData(tuple(Question(d["question"], (d["answer"],), tuple(doc_id[doc(t, s)] for t, s in d["context"]),
                               ()) for d in data), tuple(docs))


def _load(path: str, dataset: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e.msg}); RULER's {dataset} task reads the official "
                     f"{DATASETS[dataset][0]} file {DATASETS[dataset][1]}") from None


READERS = {"squad": read_squad, "hotpotqa": read_hotpotqa}


@dataclasses.dataclass(frozen=True)
class Fixed:
  data: QaData
  question: Question
  order: tuple[int, ...]        # documents in the order they are added: gold, then distractors


@dataclasses.dataclass(frozen=True)
class QA:
  dataset: str                  # squad | hotpotqa
  gen_tokens: int = 32
  metric: str = "part"
  step: int = 10                # documents

  def __post_init__(self):
    if self.dataset not in DATASETS:
      raise ValueError(f"dataset={self.dataset!r} must be one of {sorted(DATASETS)}")

  def min_size(self, fixed: Fixed) -> int:
    return len(fixed.question.gold)

  def max_size(self, coords, fixed: Fixed) -> int:
    return len(fixed.order)

  def prepare(self, coords, tokenizer, data_files) -> Fixed:
    del tokenizer
    data = READERS[self.dataset](os.path.abspath(data_path(self.dataset, data_files)))
    if not 0 <= coords.index < len(data.questions):
      raise ValueError(f"sample index={coords.index} is out of range: {DATASETS[self.dataset][1]} has "
                       f"{len(data.questions)} usable questions")
    q = data.questions[coords.index]
    rng = coords.rng()
    more = list(q.more)
    rng.shuffle(more)
    taken = set(q.gold) | set(more)
    rest = [i for i in range(len(data.docs)) if i not in taken]
    rng.shuffle(rest)
    return Fixed(data, q, tuple(q.gold) + tuple(more) + tuple(rest))

  def draft(self, coords, fixed: Fixed, size: int) -> Draft:
    chosen = list(fixed.order[:size])
    coords.rng(f"layout/{size}").shuffle(chosen)
    gold = set(fixed.question.gold)
    items = [(templates.DOCUMENT.format(i=k + 1, document=fixed.data.docs[d]), d in gold)
             for k, d in enumerate(chosen)]
    context, marked = join_marked(items, "\n\n")
    user, c0 = fill(templates.QA, context, query=fixed.question.query)
    return Draft(user=user, answer_prefix=templates.QA_PREFIX, answers=fixed.question.answers,
                 query=fixed.question.query, context=(c0, c0 + len(context)),
                 needles=tuple((t, c0 + off) for t, off in marked))
