"""The official LongBench (v1) metrics, re-implemented from the definitions in THUDM/LongBench metrics.py/eval.py.

Every metric has the official signature ``metric(prediction, ground_truth, *, all_classes) -> float in [0, 1]``;
``scorer`` turns a task's predictions into the 0–100 number of the paper tables. Behaviour that looks odd is
kept on purpose when the official code does it, because the published numbers were computed that way; each
such place says so.
"""
from __future__ import annotations

import collections
import logging
import re
import string
import warnings
from typing import Callable, Sequence

import jieba
from rouge import Rouge

with warnings.catch_warnings():
  # fuzzywuzzy warns when python-Levenshtein is absent and falls back to difflib.SequenceMatcher.
  warnings.simplefilter("ignore")
  from fuzzywuzzy import fuzz

jieba.setLogLevel(logging.WARNING)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_EN_PUNCTUATION = frozenset(string.punctuation)
_ZH_PUNCTUATION = frozenset(
    string.punctuation
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"
    + "–—‘’‛“”„‟…‧﹏.")
# Tasks whose prediction is cut to its first line before scoring (few-shot tasks: the model keeps
# writing further examples after its answer).
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# LongBench-E length buckets (by the example's `length` field, in words/characters as the data defines it).
E_BUCKETS = (("0-4k", 0, 4000), ("4-8k", 4000, 8000), ("8k+", 8000, None))


def normalize_answer(text: str) -> str:
  """SQuAD normalisation: lowercase, drop ASCII punctuation, drop the articles a/an/the, collapse spaces."""
  text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
  """Chinese normalisation: lowercase, drop ASCII and CJK punctuation, delete all whitespace."""
  return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCTUATION).split())


def token_f1(prediction_tokens: Sequence[str], truth_tokens: Sequence[str]) -> float:
  """F1 of the multiset overlap of two token lists (0 when nothing is shared)."""
  overlap = sum((collections.Counter(prediction_tokens) & collections.Counter(truth_tokens)).values())
  if overlap == 0:
    return 0.0
  precision = overlap / len(prediction_tokens)
  recall = overlap / len(truth_tokens)
  return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
  return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _zh_tokens(text: str) -> list[str]:
  tokens = (normalize_zh_answer(t) for t in jieba.cut(text, cut_all=False))
  return [t for t in tokens if t]


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
  """Token F1 over jieba words, each normalised; words that normalise to nothing are dropped."""
  return token_f1(_zh_tokens(prediction), _zh_tokens(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
  """ROUGE-L F (summary level, over unique words, sentences split at '.') from the `rouge` package.

  The official code returns 0 whenever the package raises (empty text, or a RecursionError in its recursive
  LCS reconstruction on very long sentences); so does this.
  """
  try:
    scores = Rouge(metrics=["rouge-l"]).get_scores([prediction], [ground_truth], avg=True)
  except Exception:  # noqa: BLE001 - the official metric maps every failure to 0.
    return 0.0
  return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
  """ROUGE-L F over jieba words joined by spaces."""
  return rouge_score(" ".join(jieba.cut(prediction, cut_all=False)),
                     " ".join(jieba.cut(ground_truth, cut_all=False)))


def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None,
                         **_) -> float:
  """1/(number of matched class names) if the true class is among the class names found in the prediction.

  Reproduces two quirks of the official code: (1) a matched name that is a proper substring of the ground
  truth is dropped inside a loop over the same list, so the match right after a dropped one is not checked;
  (2) its fallback to the most similar class name never runs (its guard is always true), so a prediction that
  names no class scores 0.
  """
  if not all_classes:
    raise ValueError(f"classification_score needs the task's class names; got {all_classes=}")
  matches = [name for name in all_classes if name in prediction]
  i = 0
  while i < len(matches):
    name = matches[i]
    if name in ground_truth and name != ground_truth:
      matches.remove(name)  # the next element shifts into slot i and is skipped by i += 1 (official quirk)
    i += 1
  return 1.0 / len(matches) if ground_truth in matches else 0.0


def _number_hit_rate(prediction: str, target: str) -> float:
  numbers = re.findall(r"\d+", prediction)
  if not numbers:
    return 0.0
  return sum(n == target for n in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_) -> float:
  """Fraction of the numbers in the prediction that equal the true count."""
  return _number_hit_rate(prediction, str(ground_truth))


def _paragraph_id(ground_truth: str, pattern: str) -> str:
  found = re.findall(pattern, ground_truth)
  if not found:
    raise ValueError(f"ground_truth={ground_truth!r} does not name a paragraph (expected {pattern!r})")
  return found[0]


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
  """Fraction of the numbers in the prediction equal to N of the answer 'Paragraph N'."""
  return _number_hit_rate(prediction, _paragraph_id(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
  """Fraction of the numbers in the prediction equal to N of the answer '段落N'."""
  return _number_hit_rate(prediction, _paragraph_id(ground_truth, r"段落(\d+)"))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
  """fuzz.ratio/100 between the reference line and the first predicted line that has no '`', '#' or '//'.

  fuzzywuzzy uses python-Levenshtein when installed and difflib.SequenceMatcher otherwise; the two ratios
  can differ slightly on some strings (the official requirements do not pin either).
  """
  first_code_line = ""
  for line in prediction.lstrip("\n").split("\n"):
    if "`" not in line and "#" not in line and "//" not in line:
      first_code_line = line
      break
  return fuzz.ratio(first_code_line, ground_truth) / 100


Metric = Callable[..., float]

DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
dataset2metric = DATASET2METRIC  # the official name


def base_dataset(dataset: str) -> str:
  """'qasper_e' (LongBench-E) -> 'qasper'; a v1 name is returned unchanged. Unknown names raise."""
  if dataset in DATASET2METRIC:
    return dataset
  if dataset.endswith("_e") and dataset[:-2] in DATASET2METRIC:
    return dataset[:-2]
  raise ValueError(f"dataset={dataset!r} is not a LongBench task; known: {sorted(DATASET2METRIC)} "
                   "(or one of them with the LongBench-E suffix '_e')")


def example_score(dataset: str, prediction: str, answers: Sequence[str],
                  all_classes: Sequence[str] | None) -> float:
  """One example's score in [0, 1]: first-line cut for the few-shot tasks, then the max over the answers."""
  task = base_dataset(dataset)
  if isinstance(answers, str):
    raise TypeError(f"answers must be a list of reference strings, got the string {answers!r}")
  if task in FIRST_LINE_TASKS:
    prediction = prediction.lstrip("\n").split("\n")[0]
  metric = DATASET2METRIC[task]
  best = 0.0
  for truth in answers:
    best = max(best, metric(prediction, truth, all_classes=all_classes))
  return best


def _check_lengths(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> None:
  if len(predictions) != len(answers):
    raise ValueError(f"{len(predictions)=} must equal {len(answers)=}")
  if not predictions:
    raise ValueError("scoring needs at least one prediction; got none")


def scorer(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]],
           all_classes: Sequence[str] | None) -> float:
  """The official task score: 100 × mean over examples of the best score over references, rounded to 2."""
  _check_lengths(predictions, answers)
  total = sum(example_score(dataset, p, a, all_classes) for p, a in zip(predictions, answers))
  return round(100 * total / len(predictions), 2)


def scorer_e(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]],
             lengths: Sequence[int], all_classes: Sequence[str] | None) -> dict[str, float]:
  """LongBench-E: the score per length bucket ('0-4k', '4-8k', '8k+'); an empty bucket gives NaN
  (the official code takes the mean of an empty list)."""
  _check_lengths(predictions, answers)
  if len(lengths) != len(predictions):
    raise ValueError(f"{len(lengths)=} must equal {len(predictions)=}")
  buckets: dict[str, list[float]] = {name: [] for name, _, _ in E_BUCKETS}
  for p, a, n in zip(predictions, answers, lengths):
    for name, lo, hi in E_BUCKETS:
      if n >= lo and (hi is None or n < hi):
        buckets[name].append(example_score(dataset, p, a, all_classes))
  return {name: round(100 * sum(v) / len(v), 2) if v else float("nan") for name, v in buckets.items()}
