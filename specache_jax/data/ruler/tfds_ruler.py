"""TFDS builder for a generated RULER split; importing this module registers the "ruler" dataset.

Written as ``array_record`` and read without TensorFlow::

    import tensorflow_datasets as tfds
    from specache_jax.data.ruler import tfds_ruler  # registers "ruler"
    ds = tfds.data_source("ruler/chars_tiny", split="test", data_dir=DIR)
    ds[0]["prompt"], ds[0]["answers"]

The registered configs count tokens with a built-in character tokenizer (one token per character). For a
model's own tokens pass a config naming that tokenizer and the tokenizer object itself::

    cfg = RulerConfig(name="smollm2_4k", tokenizer="smollm2", formatter="model", lengths=(4096,), samples=50)
    builder = Ruler(config=cfg, tokenizer=my_tokenizer, data_dir=DIR)
    builder.download_and_prepare()
    ds = builder.as_data_source(split="test")

Each example is `ruler.generate(task, length, index, seed, tokenizer)` for every task x length x index.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from specache_jax.data import niah
from specache_jax.data.ruler import sample as sample_lib
from specache_jax.data.ruler.tasks import SYNTHETIC, TASKS, generate

BUILTIN_TOKENIZERS = {"chars": niah.CharTokenizer}
FORMATTERS = ("plain", "chatml", "model")   # RULER's base template, ChatML text, the tokenizer's own chat()


def chatml(user: str) -> str:
  return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@dataclasses.dataclass(eq=False)
class RulerConfig(tfds.core.BuilderConfig):
  """A split: tasks x lengths (tokens of ``tokenizer``) x ``samples`` indices, one seed, one prompt format."""
  tasks: tuple[str, ...] = SYNTHETIC
  lengths: tuple[int, ...] = (4096,)
  samples: int = 10
  seed: int = 42
  tokenizer: str = "chars"            # "chars" built in; any other name needs a tokenizer object
  formatter: str = "plain"            # one of FORMATTERS
  squad: str = ""                     # qa_1: path to dev-v2.0.json
  hotpotqa: str = ""                  # qa_2: path to hotpot_dev_distractor_v1.json

  def __post_init__(self):
    unknown = [t for t in self.tasks if t not in TASKS]
    if unknown:
      raise ValueError(f"tasks {unknown} are not RULER tasks; expected some of {list(TASKS)}")
    if self.formatter not in FORMATTERS:
      raise ValueError(f"formatter={self.formatter!r} must be one of {FORMATTERS}")
    if self.samples < 1 or any(n <= 0 for n in self.lengths):
      raise ValueError(f"samples={self.samples} and lengths={self.lengths} must be positive")


class Ruler(tfds.core.GeneratorBasedBuilder):
  """RULER samples (split "test")."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
      RulerConfig(name="chars_4k", description="The 11 synthetic tasks, 4096 characters, 10 samples each."),
      RulerConfig(name="chars_tiny", tasks=("niah_single_1", "niah_multikey_2", "vt", "fwe"), lengths=(2048,),
                  samples=2, formatter="chatml", description="Four tasks at 2048 characters (tests)."),
  ]

  def __init__(self, *, tokenizer=None, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    super().__init__(**kwargs)
    cfg = self.builder_config
    if tokenizer is None and cfg.tokenizer not in BUILTIN_TOKENIZERS:
      raise ValueError(f"config tokenizer={cfg.tokenizer!r} is not built in ({sorted(BUILTIN_TOKENIZERS)}); "
                       "pass the tokenizer object as Ruler(tokenizer=...)")
    if cfg.formatter == "model" and not hasattr(tokenizer, "chat"):
      raise ValueError("formatter='model' needs a tokenizer object with chat(messages)")
    self._tokenizer = tokenizer

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="RULER samples generated with the builder's tokenizer (Hsieh et al. 2024).",
        features=tfds.features.FeaturesDict({
            "id": tfds.features.Text(),               # e.g. "vt/len=4096/i=3"
            "task": tfds.features.Text(),
            "length": np.int32,                       # prompt tokens + gen_tokens <= length
            "index": np.int32,
            "seed": np.int32,
            "prompt": tfds.features.Text(),           # ends with the answer prefix
            "prompt_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "answers": tfds.features.Sequence(tfds.features.Text()),
            "answer_prefix": tfds.features.Text(),
            "query": tfds.features.Text(),
            "gen_tokens": np.int32,
            "metric": tfds.features.Text(),           # "all" (string_match_all) | "part" (string_match_part)
            "haystack_size": np.int32,
            "context_start": np.int32,                # prompt[context_start:context_end] is the haystack
            "context_end": np.int32,
            "needle_texts": tfds.features.Sequence(tfds.features.Text()),
            "needle_starts": tfds.features.Tensor(shape=(None,), dtype=np.int32),   # char offsets in prompt
        }),
        supervised_keys=None,
        homepage="https://github.com/NVIDIA/RULER",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is generated (the QA files are read from local paths)
    return {"test": self._generate_examples()}

  def _generate_examples(self):
    cfg = self.builder_config
    tok = self._tokenizer or BUILTIN_TOKENIZERS[cfg.tokenizer]()
    formatter = {"plain": sample_lib.plain, "chatml": chatml}.get(cfg.formatter) or sample_lib.chat(tok)
    files = {"squad": cfg.squad, "hotpotqa": cfg.hotpotqa}
    for task in cfg.tasks:
      for n in cfg.lengths:
        for i in range(cfg.samples):
          s = generate(task, n, i, cfg.seed, tok, formatter=formatter, data_files=files)
          yield s.id, {
              "id": s.id, "task": s.task, "length": s.length, "index": s.index, "seed": s.seed,
              "prompt": s.prompt, "prompt_ids": np.asarray(s.prompt_ids, np.int32), "answers": list(s.answers),
              "answer_prefix": s.answer_prefix, "query": s.query, "gen_tokens": s.gen_tokens,
              "metric": s.metric, "haystack_size": s.size, "context_start": s.context[0],
              "context_end": s.context[1], "needle_texts": [x.text for x in s.needles],
              "needle_starts": np.asarray([x.start for x in s.needles], np.int32),
          }
