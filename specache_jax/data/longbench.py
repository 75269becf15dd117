"""LongBench (v1) data path: the official jsonl layout, prompt templates, generation lengths, middle truncation,
the scorer and the paper's per-task table.

Data layout (what `THUDM/LongBench`'s data.zip unpacks to): one ``<dataset>.jsonl`` per task in one directory
(``<dataset>_e.jsonl`` for LongBench-E), each line a JSON object with the fields in ``FIELDS``.
Facts (templates, maximum new tokens, which tasks skip the chat template) follow the official repository's
``config/dataset2prompt.json``, ``config/dataset2maxlen.json`` and ``pred.py``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Callable, Iterable, Mapping, Sequence

from specache_jax.data.longbench_metrics import (  # noqa: F401 - re-exported: the scorer lives with the data
    DATASET2METRIC, FIRST_LINE_TASKS, base_dataset, dataset2metric, example_score, scorer, scorer_e)

DATASETS = ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
            "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
            "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p")
# LongBench-E: the tasks with length-balanced variants, read from `<dataset>_e.jsonl`.
DATASETS_E = tuple(f"{d}_e" for d in (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
    "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"))

# The 15 English tasks of the paper's LongBench table (SPECACHE.md §7), in its column order.
PAPER_TASKS: tuple[tuple[str, str], ...] = (
    ("narrativeqa", "NrtvQA"), ("qasper", "Qasper"), ("multifieldqa_en", "MF-en"), ("hotpotqa", "HotpotQA"),
    ("2wikimqa", "2WikiMQA"), ("musique", "Musique"), ("gov_report", "GovReport"), ("qmsum", "QMSum"),
    ("multi_news", "MultiNews"), ("trec", "TREC"), ("triviaqa", "TriviaQA"), ("samsum", "SAMSum"),
    ("passage_retrieval_en", "PassageRetrieval-en"), ("lcc", "LCC"), ("repobench-p", "RepoBench-P"))

# Tasks the official pred.py feeds raw (no chat template): few-shot and code continuation.
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# Tasks where the official pred.py also stops generation at a newline token (besides EOS).
STOP_AT_NEWLINE = frozenset({"samsum"})

_QA_PASSAGES = ("Answer the question based on the given passages. Only give me the answer and do not output any "
                "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on "
                "the given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
                "{input}\nAnswer:")
_QASPER_RULES = ("as concisely as you can, using a single phrase or sentence if possible. If the question cannot "
                 "be answered based on the information in the article, write \"unanswerable\". If the question "
                 "is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
                 "explanation.")
# "asconcisely" is the spelling of the released v1 template (and of the copies KV-cache papers evaluate with).
_NARRATIVE_RULES = "asconcisely as you can, using a single phrase if possible. Do not provide any explanation."

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": ("You are given a story, which can be either a novel or a movie script, and a question. "
                    f"Answer the question {_NARRATIVE_RULES}\n\nStory: {{context}}\n\nNow, answer the question "
                    f"based on the story {_NARRATIVE_RULES}\n\nQuestion: {{input}}\n\nAnswer:"),
    "qasper": (f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\n"
               f"Article: {{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\n"
               "Question: {input}\n\nAnswer:"),
    "multifieldqa_en": ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
                        "question based on the above text, only give me the answer and do not output any other "
                        "words.\n\nQuestion: {input}\nAnswer:"),
    "multifieldqa_zh": ("阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，"
                        "只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": ("You are given a report by a government agency. Write a one-page summary of the report.\n\n"
                   "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"),
    "qmsum": ("You are given a meeting transcript and a query containing a question or instruction. Answer the "
              "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
              "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"),
    "multi_news": ("You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
                   "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": ("Please determine the type of the question below. Here are some examples of questions.\n\n"
             "{context}\n{input}"),
    "triviaqa": ("Answer the question based on the given passage. Only give me the answer and do not output any "
                 "other words. The following are some examples.\n\n{context}\n\n{input}"),
    "samsum": ("Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
               "{context}\n\n{input}"),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": ("There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
                      "Please carefully read these paragraphs and determine how many unique paragraphs there are "
                      "after removing duplicates. In other words, how many non-repeating paragraphs are there in "
                      "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing "
                      "duplicates. The output format should only contain the number, such as 1, 2, 3, and so "
                      "on.\n\nThe final answer is: "),
    "passage_retrieval_en": ("Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine "
                             "which paragraph the abstract is from.\n\n{context}\n\nThe following is an "
                             "abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract "
                             "is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\n"
                             "The answer is: "),
    "passage_retrieval_zh": ("以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n"
                             "下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，"
                             "\"段落2\"等格式\n\n答案是："),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}

FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


@dataclasses.dataclass(frozen=True)
class Example:
  """One LongBench record. ``id`` is the jsonl field ``_id``; ``all_classes`` is None for non-classification
  tasks (the jsonl holds null)."""
  input: str
  context: str
  answers: tuple[str, ...]
  length: int
  dataset: str
  language: str
  all_classes: tuple[str, ...] | None
  id: str


def max_new_tokens(dataset: str) -> int:
  """The official maximum generation length of a task (LongBench-E names map to their base task)."""
  return DATASET2MAXLEN[base_dataset(dataset)]


def uses_chat_template(dataset: str) -> bool:
  """Whether the official pred.py wraps this task's prompt in the model's chat template."""
  return base_dataset(dataset) not in NO_CHAT_TEMPLATE


def format_prompt(dataset: str, example: Example) -> str:
  """The task template filled with the example's context and input (before any truncation)."""
  return DATASET2PROMPT[base_dataset(dataset)].format(context=example.context, input=example.input)


def truncate_middle(ids: Sequence[int], max_tokens: int) -> tuple[Sequence[int], Sequence[int]]:
  """(head, tail) kept by the official middle truncation: all ids if they fit (tail empty), else the first
  and the last ``max_tokens // 2`` ids each (so an odd budget keeps max_tokens - 1)."""
  if max_tokens < 2:
    raise ValueError(f"{max_tokens=} must be >= 2 (the official cut keeps max_tokens // 2 at each end)")
  if len(ids) <= max_tokens:
    return ids, ids[:0]
  half = max_tokens // 2
  return ids[:half], ids[len(ids) - half:]


def build_prompt(dataset: str, example: Example, tokenizer_encode: Callable[[str], Sequence[int]],
                 tokenizer_decode: Callable[[Sequence[int]], str], max_prompt_tokens: int) -> str:
  """The official prompt text: template, then (if it has more than ``max_prompt_tokens`` tokens) the decoded
  first half and last half of its token ids, joined.

  ``tokenizer_encode`` should add special tokens as the model's tokenizer does by default and
  ``tokenizer_decode`` should skip them (as pred.py does). The chat template is not applied here; apply it
  when ``uses_chat_template(dataset)``.
  """
  prompt = format_prompt(dataset, example)
  ids = tokenizer_encode(prompt)
  head, tail = truncate_middle(ids, max_prompt_tokens)
  if len(tail) == 0:
    return prompt
  return tokenizer_decode(head) + tokenizer_decode(tail)


def _expected_layout(path: pathlib.Path) -> str:
  return (f"expected the official LongBench layout: {path}/<dataset>.jsonl per task (e.g. {path}/qasper.jsonl, "
          f"or <dataset>_e.jsonl for LongBench-E), one JSON object per line with fields {list(FIELDS)}")


def _parse_example(record: object, where: str) -> Example:
  if not isinstance(record, Mapping):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  missing = [f for f in FIELDS if f not in record]
  if missing:
    raise ValueError(f"{where}: missing field(s) {missing}; a LongBench record has {list(FIELDS)}")
  answers, classes = record["answers"], record["all_classes"]
  if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
    raise ValueError(f"{where}: answers={answers!r} must be a list of strings")
  if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
    raise ValueError(f"{where}: all_classes={classes!r} must be null or a list of strings")
  length = record["length"]
  if isinstance(length, bool) or not isinstance(length, int):
    raise ValueError(f"{where}: length={length!r} must be an integer")
  for name in ("input", "context", "dataset", "language", "_id"):
    if not isinstance(record[name], str):
      raise ValueError(f"{where}: {name}={record[name]!r} must be a string")
  return Example(input=record["input"], context=record["context"], answers=tuple(answers), length=length,
                 dataset=record["dataset"], language=record["language"],
                 all_classes=None if classes is None else tuple(classes), id=record["_id"])


def read_jsonl_file(path: str | pathlib.Path, limit: int | None = None) -> list[Example]:
  """The examples of one ``<dataset>.jsonl`` file (the first ``limit`` when given); blank lines are skipped."""
  path = pathlib.Path(path)
  examples = []
  with path.open(encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if limit is not None and len(examples) >= limit:
        break
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: malformed JSON ({e.msg} at column {e.colno})") from e
      examples.append(_parse_example(record, f"{path}:{line_no}"))
  return examples


def read_jsonl_dir(path: str | pathlib.Path, datasets: Iterable[str] | None = None,
                   limit: int | None = None) -> dict[str, list[Example]]:
  """{dataset: examples} from a directory in the official layout.

  ``datasets=None`` reads every known task file present (v1 names and ``_e`` names); otherwise each named
  task must have its file. ``limit`` keeps the first ``limit`` examples of each task.
  """
  root = pathlib.Path(path)
  if limit is not None and limit < 1:
    raise ValueError(f"{limit=} must be >= 1 or None")
  if not root.is_dir():
    raise FileNotFoundError(f"LongBench directory {root} does not exist or is not a directory; "
                            + _expected_layout(root))
  if datasets is None:
    names = [d for d in DATASETS + DATASETS_E if (root / f"{d}.jsonl").is_file()]
    if not names:
      raise FileNotFoundError(f"no LongBench task file found in {root}; " + _expected_layout(root))
  else:
    names = list(datasets)
    for name in names:
      base_dataset(name)  # unknown task names fail here, with the list of known ones
      if not (root / f"{name}.jsonl").is_file():
        raise FileNotFoundError(f"task file {root / f'{name}.jsonl'} is missing; " + _expected_layout(root))
  return {name: read_jsonl_file(root / f"{name}.jsonl", limit=limit) for name in names}


def format_table(scores: Mapping[str, Mapping[str, float]],
                 tasks: Sequence[tuple[str, str]] = PAPER_TASKS) -> str:
  """A markdown table: one row per method, one column per task (short names, paper order) and the average.

  A task missing from a method shows '-'; that method's average is then over the tasks it has and is marked
  with '*' (the paper's averages are over all columns).
  """
  if not scores:
    raise ValueError("format_table needs at least one method; got an empty mapping")
  lines = ["| Method | " + " | ".join(short for _, short in tasks) + " | Avg |",
           "|---|" + "---:|" * (len(tasks) + 1)]
  partial = False
  for method, per_task in scores.items():
    present = [float(per_task[d]) for d, _ in tasks if d in per_task and not math.isnan(float(per_task[d]))]
    cells = [f"{float(per_task[d]):.2f}" if d in per_task else "-" for d, _ in tasks]
    if present:
      avg = f"{sum(present) / len(present):.2f}"
    else:
      avg = "-"
    if len(present) < len(tasks) and present:
      avg += "*"
      partial = True
    lines.append(f"| {method} | " + " | ".join(cells) + f" | {avg} |")
  if partial:
    lines.append("")
    lines.append("\\* average over the tasks present only.")
  return "\n".join(lines)
