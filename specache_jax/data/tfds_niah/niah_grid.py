"""TFDS builder for a Needle-in-a-Haystack grid (one example per context length x depth cell).

Written as ``array_record`` and read without TensorFlow::

    import tensorflow_datasets as tfds
    from specache_jax.data import tfds_niah  # registers "niah_grid"
    ds = tfds.data_source("niah_grid/whitespace_tiny", split="test", data_dir=DIR)
    ds[0]["prompt"], ds[0]["needle_start"]

Lengths are counted by the builder's tokenizer. The registered configs use ``WhitespaceTokenizer`` (one token
per whitespace-separated word; the haystack's line breaks become single spaces). For a model's own tokens
pass a config naming that tokenizer and the tokenizer object itself::

    cfg = NiahGridConfig(name="smollm2_niah", tokenizer="smollm2", context_lengths=(1024, 2048),
                         depths=(0.0, 0.5, 1.0), formatter="chatml")
    builder = NiahGrid(config=cfg, tokenizer=my_tokenizer, data_dir=DIR)
    builder.download_and_prepare()
    ds = builder.as_data_source(split="test")

``prompt_ids`` are then that tokenizer's ids (for the whitespace tokenizer they index a vocabulary that only
exists while building, so use the text fields instead).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from specache_jax.data import corpora, niah

FORMATTERS = {"plain": niah.plain_prompt, "chatml": niah.chatml_prompt}
BUILTIN_TOKENIZERS = {"whitespace": niah.WhitespaceTokenizer, "chars": niah.CharTokenizer}


@dataclasses.dataclass(eq=False)
class NiahGridConfig(tfds.core.BuilderConfig):
  """A grid: lengths (tokens of ``tokenizer``) x depths, one haystack, one needle, one prompt format."""
  context_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
  depths: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
  haystack: str = "paul_graham"        # corpora.long_text name
  tokenizer: str = "whitespace"        # "whitespace" | "chars" built in; any other name needs a tokenizer object
  formatter: str = "plain"             # key of FORMATTERS
  reserve_tokens: int = 0              # kept free in each prompt (e.g. for the answer)
  needle: niah.NeedleSpec = niah.NeedleSpec()

  def __post_init__(self):
    if self.haystack not in corpora.LONG_TEXTS:
      raise ValueError(f"haystack={self.haystack!r} must be one of {corpora.LONG_TEXTS}")
    if self.formatter not in FORMATTERS:
      raise ValueError(f"formatter={self.formatter!r} must be one of {sorted(FORMATTERS)}")
    list(niah.grid(self.context_lengths, self.depths))  # validates lengths and depths


class NiahGrid(tfds.core.GeneratorBasedBuilder):
  """NIAH prompts over a grid of context lengths and needle depths (split "test")."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
      NiahGridConfig(name="whitespace", description="Paul Graham essays, 1k-8k whitespace tokens."),
      NiahGridConfig(name="whitespace_tiny", context_lengths=(64, 128), depths=(0.0, 0.5, 1.0),
                     description="Paul Graham essays, 64 and 128 whitespace tokens (tests)."),
      NiahGridConfig(name="austen_whitespace", haystack="austen",
                     description="Jane Austen's novels, 1k-8k whitespace tokens."),
  ]

  def __init__(self, *, tokenizer: niah.Tokenizer | None = None, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    super().__init__(**kwargs)
    name = self.builder_config.tokenizer
    if tokenizer is None and name not in BUILTIN_TOKENIZERS:
      raise ValueError(f"config tokenizer={name!r} is not built in ({sorted(BUILTIN_TOKENIZERS)}); "
                       f"pass the tokenizer object as NiahGrid(tokenizer=...)")
    self._tokenizer = tokenizer

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Needle-in-a-Haystack prompts (needle at a sentence boundary near each depth).",
        features=tfds.features.FeaturesDict({
            "id": tfds.features.Text(),               # e.g. "len=1024_depth=0.50"
            "context_length": np.int32,               # requested prompt budget, in tokens
            "depth": np.float32,                      # requested depth
            "depth_used": np.float32,                 # after the sentence-boundary backoff
            "prompt": tfds.features.Text(),
            "prompt_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "needle_start": np.int32,                 # prompt_ids[needle_start:needle_end] holds the needle
            "needle_end": np.int32,
            "needle": tfds.features.Text(),
            "question": tfds.features.Text(),
            "answer_keywords": tfds.features.Sequence(tfds.features.Text()),
        }),
        supervised_keys=None,
        homepage="https://github.com/gkamradt/LLMTest_NeedleInAHaystack",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is local
    return {"test": self._generate_examples()}

  def _generate_examples(self):
    cfg = self.builder_config
    tokenizer = self._tokenizer or BUILTIN_TOKENIZERS[cfg.tokenizer]()
    haystack = corpora.long_text(cfg.haystack)
    for cell in niah.grid(cfg.context_lengths, cfg.depths):
      case = niah.build_case(tokenizer, haystack, cfg.needle, cell.context_length, cell.depth,
                             formatter=FORMATTERS[cfg.formatter], reserve_tokens=cfg.reserve_tokens)
      yield cell.id, {
          "id": cell.id,
          "context_length": cell.context_length,
          "depth": cell.depth,
          "depth_used": case.depth,
          "prompt": case.prompt,
          "prompt_ids": np.asarray(case.prompt_ids, np.int32),
          "needle_start": case.needle_start,
          "needle_end": case.needle_end,
          "needle": cfg.needle.needle,
          "question": cfg.needle.question,
          "answer_keywords": list(cfg.needle.answer_keywords),
      }
