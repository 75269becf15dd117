"""RULER's metrics (its `scripts/eval`): a prediction is cleaned (stripped; control characters become newlines;
stripped again) and checked for each reference, case-insensitively, as a substring.

- string_match_all (niah, vt, cwe, fwe): the fraction of references found, averaged over samples, x100.
- string_match_part (qa): 1 when any reference is found, averaged over samples, x100.
Both round to 2 decimals, as RULER does.
"""
from __future__ import annotations

import re
from typing import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean(prediction: str) -> str:
  return _CONTROL.sub("\n", prediction.strip()).strip()


def sample_score(prediction: str, references: Sequence[str], metric: str) -> float:
  """One sample's score in [0, 1]: "all" = fraction of references found, "part" = any found."""
  if not references:
    raise ValueError("references must not be empty")
  pred = clean(prediction).lower()
  found = [r.lower() in pred for r in references]
  if metric == "all":
    return sum(found) / len(found)
  if metric == "part":
    return float(any(found))
  raise ValueError(f"{metric=} must be 'all' (string_match_all) or 'part' (string_match_part)")


def _mean(preds, refs, metric) -> float:
  if len(preds) != len(refs) or not preds:
    raise ValueError(f"need as many predictions ({len(preds)}) as reference lists ({len(refs)}), at least one")
  return round(sum(sample_score(p, r, metric) for p, r in zip(preds, refs)) / len(preds) * 100, 2)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
  return _mean(preds, refs, "all")


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
  return _mean(preds, refs, "part")
