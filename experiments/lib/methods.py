"""Cache methods of an experiment, from its config: `config.methods` holds one entry per label, e.g.

    methods.specache_1bit = dict(name="specache", bits=1, group_size=64, residual=64, topk=64)
    methods.h2o = dict(name="h2o", match="specache_1bit")      # budget = that method's device bytes

and `config.run_methods` ("full,kivi_1bit,...") picks which run, in order. `match` sizes a budget-sized method
(StreamingLLM, H2O, Quest, InfLLM) with `caches.budget.matched_budget` at every context length separately, since the
reference's device bytes grow with the context.

`config.extra_methods` adds labels from the command line (`parse_extra`), e.g.

    --config.extra_methods="kivi_2bit_g32=kivi:bits=2,group_size=32;spec1_robust=specache:bits=1,preset=robust"

Each one joins `config.methods` (a label already there is an error) and runs after `run_methods`' labels unless
`run_methods` names it. Every sweep reads its labels through `labels` / `spec_of`, so no launcher parses it.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from specache_jax.caches import METHOD_NAMES, CacheConfig, cache_config
from specache_jax.caches.base import settings_of
from specache_jax.caches.budget import matched_budget
from specache_jax.errors import ConfigError
from specache_jax.model_config import ModelConfig


def _as_dict(spec) -> dict[str, Any]:
  return dict(spec.to_dict() if hasattr(spec, "to_dict") else spec)


def labels(config) -> list[str]:
  """The labels in `config.run_methods`, each checked against `config.methods` (with `config.extra_methods`),
  then the extra labels `run_methods` does not name, in their order."""
  chosen = [s.strip() for s in str(config.run_methods).split(",") if s.strip()]
  specs = all_specs(config)
  known = list(specs)
  unknown = [c for c in chosen if c not in known]
  if unknown:
    raise ConfigError(f"run_methods={config.run_methods!r} names {unknown}, not in config.methods {known}")
  chosen += [label for label in extra_specs(config) if label not in chosen]
  if not chosen:
    raise ConfigError(f"run_methods={config.run_methods!r} selects no method; choose from {known}")
  return chosen


# Per-label options an experiment reads itself (never passed to the cache config):
#   spec_row: perplexity's speculative-row token, "model" (its own guess, as in decoding) or "text" (oracle).
RUN_OPTIONS = ("spec_row",)


def options(config, label: str) -> dict[str, Any]:
  spec = spec_of(config, label)
  return {k: spec[k] for k in RUN_OPTIONS if k in spec}


def spec_of(config, label: str) -> dict[str, Any]:
  spec = _as_dict(all_specs(config)[label])
  if "name" not in spec:
    raise ConfigError(f"config.methods.{label} has no 'name' (one of {', '.join(METHOD_NAMES)})")
  return spec


def build(config, label: str, model_cfg: ModelConfig, max_len: int, dtype,
          run_options: tuple[str, ...] = ()) -> CacheConfig:
  """The cache config of `label` for sequences of up to `max_len` tokens (prompt + generation).

  run_options: the per-label options (RUN_OPTIONS) the calling experiment reads itself; any other one in the
  label's spec is an error (e.g. perplexity's spec_row in a NIAH sweep would otherwise be silently ignored).
  """
  spec = spec_of(config, label)
  name = spec.pop("name")
  match = spec.pop("match", None)
  for key in RUN_OPTIONS:
    if key in spec and key not in run_options:
      raise ConfigError(f"config.methods.{label}.{key}={spec[key]!r}: this experiment does not use {key!r} "
                        f"(only {', '.join(run_options) or 'no per-label options'}); remove it or run the "
                        "experiment that reads it")
    spec.pop(key, None)
  if match is None:
    return cache_config(name, **spec)
  if match == label:
    raise ConfigError(f"config.methods.{label}.match={match!r} cannot match itself")
  ref = build(config, match, model_cfg, max_len, dtype, run_options=RUN_OPTIONS)   # only its bytes matter
  return matched_budget(name, ref, model_cfg, max_len, dtype, **spec)


def describe(method: CacheConfig) -> dict[str, Any]:
  """JSON-ready settings of a built method (what goes into a result record and its fingerprint)."""
  return {"name": method.name, **{k: v for k, v in settings_of(method).items()}}

# ---- methods added from the command line: config.extra_methods ----

_LABEL = re.compile(r"[A-Za-z0-9_.-]+")
_SYNTAX = "'label=method' or 'label=method:key=value,key=value', parts separated by ';'"


def parse_value(text: str) -> Any:
  """A setting's value as written on the command line: true/false -> bool, none -> None, then int, float, else
  the text itself (a preset's name, a `match` label, `one_bit=kivi`)."""
  low = text.lower()
  if low in ("true", "false"):
    return low == "true"
  if low == "none":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def parse_extra(text: str) -> dict[str, dict[str, Any]]:
  """`config.extra_methods` -> {label: spec}: "label=method:key=value,...;label2=method2" (empty parts are
  skipped). Checks the syntax, the method's name and the keys it takes (`caches.cache_config`'s own check),
  each error naming the part at fault; what needs the model (a group size that divides head_dim, a `match`
  label's bytes) is checked when the label is built."""
  out: dict[str, dict[str, Any]] = {}
  for part in (p.strip() for p in str(text or "").split(";")):
    if not part:
      continue
    head, _, body = part.partition(":")
    label, eq, name = (s.strip() for s in head.partition("="))
    if not eq or not label or not name:
      raise ConfigError(f"extra_methods part {part!r} must be {_SYNTAX}")
    if not _LABEL.fullmatch(label):
      raise ConfigError(f"extra_methods label {label!r} (in {part!r}) must use only letters, digits, '_', '.', '-'")
    if label in out:
      raise ConfigError(f"extra_methods label {label!r} appears twice ({part!r}); labels must be unique")
    spec: dict[str, Any] = {"name": name}
    for pair in (p.strip() for p in body.split(",")) if body.strip() else ():
      key, eq, value = (s.strip() for s in pair.partition("="))
      if not eq or not key or not value:
        raise ConfigError(f"extra_methods {label}: setting {pair!r} must be key=value (in {part!r}; {_SYNTAX})")
      if key in spec:
        raise ConfigError(f"extra_methods {label}: setting {key!r} given twice (in {part!r})")
      spec[key] = parse_value(value)
    settings = {k: v for k, v in spec.items() if k not in ("name", "match", *RUN_OPTIONS)}
    try:
      cache_config(name, **settings)
    except (ConfigError, TypeError, ValueError) as e:
      raise ConfigError(f"extra_methods {label} ({part!r}): {e}") from None
    out[label] = spec
  return out


def extra_specs(config) -> dict[str, dict[str, Any]]:
  """The labels `config.extra_methods` adds ({} when the config has no such field)."""
  return parse_extra(getattr(config, "extra_methods", "") or "")


def all_specs(config) -> dict[str, Any]:
  """`config.methods` plus `config.extra_methods`' labels; an extra label already in `config.methods`, or an
  extra `match` naming no label, is a ConfigError."""
  specs = _as_dict(config.methods)
  extra = extra_specs(config)
  clash = [label for label in extra if label in specs]
  if clash:
    raise ConfigError(f"extra_methods={config.extra_methods!r} adds {clash}, already in config.methods; pick "
                      "another label (or change the existing one with --config.methods.<label>.<key>=...)")
  specs.update(extra)
  for label, spec in extra.items():
    if "match" in spec and spec["match"] not in specs:
      raise ConfigError(f"extra_methods {label}: match={spec['match']!r} names no label of config.methods or "
                        f"extra_methods ({list(specs)})")
  return specs



def settings_fingerprint_parts(config, label: str) -> Mapping[str, Any]:
  """The unresolved spec (plus its match's, recursively; plus a preset's resolved settings, which change when
  the preset is redefined): enough to tell whether a stored cell is stale."""
  spec = spec_of(config, label)
  if "match" in spec:
    spec["match_spec"] = dict(settings_fingerprint_parts(config, spec["match"]))
  if "preset" in spec:
    kw = {k: v for k, v in spec.items() if k not in ("name", "match", "match_spec", *RUN_OPTIONS)}
    resolved = settings_of(cache_config(spec["name"], **kw))
    spec["preset_settings"] = {**RETIRED_OFF, **{k: v for k, v in resolved.items()
                                                 if k not in ADDED_ON or v != ADDED_ON[k]}}
  return spec


# Options SpeCache had when the committed cells were computed, at the value every preset had them (off): part of a
# preset label's resolved settings, so those cells' fingerprints still match (docs/speculation.md: why removed).
RETIRED_OFF = dict(hedge=0, hedge_shift=0, drift=0.0, candidate_merge="max", score_levels="stored")
# Options SpeCache gained after those cells were computed, at the value that behaves as before (pre-decoding on):
# left out of a preset label's resolved settings at that value, so its fingerprint is the one it had before.
ADDED_ON = dict(predecode=True)


def standard() -> dict[str, dict[str, Any]]:
  """The methods the paper compares, at its settings (SPECACHE.md §6), keyed by label. Configs copy this
  into `config.methods` and pick labels with `config.run_methods`."""
  return {
      "full": dict(name="full"),                                               # 16-bit cache, the reference
      "kivi_1bit": dict(name="kivi", bits=1, group_size=64, residual=128),     # KIVI's own 1-bit rule (m, M)
      "kivi_2bit": dict(name="kivi", bits=2, group_size=64, residual=128),
      "specache_1bit": dict(name="specache", bits=1, group_size=64, residual=64, topk=64),
      "specache_2bit": dict(name="specache", bits=2, group_size=64, residual=64, topk=64),
      "streaming": dict(name="streaming", match="specache_1bit"),              # sinks + window, same bytes
      "h2o": dict(name="h2o", match="specache_1bit"),                          # heavy hitters, same bytes
  }


def retrieval() -> dict[str, dict[str, Any]]:
  """The retrieval baselines beside SpeCache, at SpeCache 1-bit's device bytes (the same 16-bit cache kept off
  the device, a different choice of the rows attended), keyed by label. InfLLM keeps its paper's settings (128
  initial tokens, blocks of 128): on SmolLM2-135M (bf16) SpeCache 1-bit's bytes do not hold its smallest budget
  (256) at 2,074 cache slots (12.00 vs 12.17 MB: `matched_budget` refuses; NIAH's 2k cells) and retrieve its
  first block from about 4.3k (below, it attends its initial tokens and window only). `infllm_b32` scales it to
  such short contexts (32 initial tokens, blocks of 32; the paper's 1:2 split of the rest): at SpeCache 1-bit's
  bytes it retrieves 1 block at 1k and 2 at 2k."""
  return {
      "quest": dict(name="quest", match="specache_1bit"),      # pages by their min/max key bounds, same bytes
      "infllm": dict(name="infllm", match="specache_1bit"),    # initial + window + blocks by representatives
      "infllm_b32": dict(name="infllm", match="specache_1bit", n_init=32, block_size=32),   # short contexts
  }


def robust() -> dict[str, dict[str, Any]]:
  """SpeCache 1-bit (the paper's settings) with its speculation variants (caches/speculation.py,
  docs/speculation.md): the critical-path references (exact_on_miss, non-speculative), each option alone, the
  robust preset and its earlier forms, keyed by label — the labels committed results name."""
  base = standard()["specache_1bit"]
  # the robust preset before prompt lookup (its cells' label until then: specache_1bit_robust); the robust_*
  # variants below are that combination with one change
  former = dict(base, candidates=3, exact_on_miss=True, correct_with_fetched=True, lowbit_in_output=False)
  # the preset with KIVI's rule for the ring's keys (before exact_ring): its earlier labels below pin it
  kivi_ring = dict(preset="robust", exact_ring=False, skip_ring=False)
  return {
      "specache_1bit_eom": dict(base, exact_on_miss=True),                      # refetch after a wrong token
      "specache_1bit_nonspec": dict(base, speculative=False),                   # κ_t from T_t, always on the path
      "specache_1bit_skipring": dict(base, skip_ring=True),
      "specache_1bit_exactring": dict(base, exact_ring=True, skip_ring=True),   # the ring's 16-bit keys, κ outside it
      # the preset (caches/specache.py): its own k (128, half of it for anchors), not the paper's 64
      "specache_1bit_robust": dict({k: v for k, v in base.items() if k != "topk"}, preset="robust"),
      # the preset until it read the ring's 16-bit keys (exact_ring, skip_ring): the ring's last quantized
      # window scored and attended with its low-bit keys (KIVI's rule)
      "specache_1bit_robust_kiviring": dict({k: v for k, v in base.items() if k != "topk"}, **kivi_ring),
      # the preset until anchors kept half of κ for the scores: k = 64, all of it for anchors
      "specache_1bit_robust_k64": dict(base, **kivi_ring, lookup_rows=64),
      "specache_1bit_cand2": dict(base, candidates=2),          # the 2 likeliest next tokens, max-merged
      "specache_1bit_cand3": dict(base, candidates=3),
      "specache_1bit_cand2eom": dict(base, candidates=2, exact_on_miss=True),  # refetch only if both missed
      "specache_1bit_cand3eom": dict(base, candidates=3, exact_on_miss=True),
      # the rest of the byte budget (<= 0.12x the full cache, bf16, 8k) spent on fetched rows: k=128 is
      # 0.117x (k=64: 0.109x); twice the host->device rows per step
      "specache_1bit_k128": dict(base, topk=128),
      "specache_1bit_k128eom": dict(base, topk=128, exact_on_miss=True),
      "specache_1bit_k128cand3eom": dict(base, topk=128, candidates=3, exact_on_miss=True),
      # the low-bit copy only scores: a decoding step's output attends κ_t, the ring and the new rows
      "specache_1bit_scoreonly": dict(base, lowbit_in_output=False),
      "specache_1bit_eom_scoreonly": dict(base, exact_on_miss=True, lowbit_in_output=False),
      "specache_1bit_cand3eom_scoreonly": dict(base, candidates=3, exact_on_miss=True, lowbit_in_output=False),
      # ... and a synchronous κ_t choice scores the prefetched rows from their 16-bit keys
      "specache_1bit_eom_fetched_scoreonly": dict(base, exact_on_miss=True, correct_with_fetched=True,
                                                  lowbit_in_output=False),
      "specache_1bit_cand3eom_fetched_scoreonly": former,
      "specache_1bit_robust_k128": dict(former, topk=128),
      # KIVI's 1-bit levels (m, M) rank the needle higher (results/speculation/needle_rank); stored as the levels
      # (one_bit="kivi") they also reach the pre-decoding pass's output and the ring's keys and break the answers
      "specache_1bit_robust_kivi": dict(former, one_bit="kivi"),
      # the k = 64 preset above with anchors only on repeats of 4+ tokens (matched up to 8): fewer anchors in prose
      "specache_1bit_robust_match4": dict(base, **kivi_ring, lookup_rows=64, lookup=8, anchor_match=4),
      # ... on repeats of 6+ (the last 3 steps' lookups were right: a copy in progress, not a common phrase)
      "specache_1bit_robust_match6": dict(base, **kivi_ring, lookup_rows=64, lookup=8, anchor_match=6),
      # ... with half of κ for the anchors (one 32-row window; the needle's rows fit one): 32 rows stay scored
      "specache_1bit_robust_r32": dict(base, **kivi_ring, lookup_rows=32),
      "specache_1bit_robust_r32m4": dict(base, **kivi_ring, lookup_rows=32, lookup=8, anchor_match=4),
  }
