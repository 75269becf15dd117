"""TFDS ``GeneratorBasedBuilder`` over the official LongBench jsonl layout, written as ``array_record``.

TensorFlow is not needed: records are written as array_record and read back with ``tfds.data_source``
(``tfds.load`` / ``as_numpy`` would need TensorFlow). The jsonl directory is the builder kwarg ``jsonl_dir`` or,
failing that, the download config's ``manual_dir``.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import numpy as np
import tensorflow_datasets as tfds

from specache_jax.data import longbench

# TFDS config names: the task names, with '-' spelled '_' ('repobench-p' -> 'repobench_p').
CONFIG_NAMES: dict[str, str] = {d: d.replace("-", "_") for d in longbench.DATASETS + longbench.DATASETS_E}
_TASK_OF_CONFIG = {c: d for d, c in CONFIG_NAMES.items()}


def config_name(dataset: str) -> str:
  """The builder config name of a LongBench task ('repobench-p' -> 'repobench_p')."""
  if dataset not in CONFIG_NAMES:
    raise ValueError(f"dataset={dataset!r} has no LongBench builder config; known: {sorted(CONFIG_NAMES)}")
  return CONFIG_NAMES[dataset]


class LongBench(tfds.core.GeneratorBasedBuilder):
  """LongBench v1 and LongBench-E tasks from local jsonl files; one config per task, one split 'test'."""

  name = "longbench"
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Official LongBench v1 / LongBench-E jsonl fields."}
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=c, description=f"LongBench task {d}")
                     for d, c in CONFIG_NAMES.items()]
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Unpack the official LongBench data (data.zip of THUDM/LongBench) so that one directory holds "
      "<dataset>.jsonl per task, and pass it as builder kwarg jsonl_dir=... or as the download config's "
      "manual_dir.")

  def __init__(self, *, jsonl_dir: str | pathlib.Path | None = None, file_format: str = "array_record",
               **kwargs: Any):
    self._jsonl_dir = None if jsonl_dir is None else pathlib.Path(jsonl_dir)
    super().__init__(file_format=file_format, **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            "input": text,
            "context": text,
            "answers": tfds.features.Sequence(tfds.features.Text()),
            "all_classes": tfds.features.Sequence(tfds.features.Text()),  # empty where the jsonl holds null
            "length": tfds.features.Scalar(dtype=np.int64),
            "dataset": tfds.features.Text(),
            "language": tfds.features.Text(),
            "_id": tfds.features.Text(),
        }),
        homepage="https://github.com/THUDM/LongBench",
        disable_shuffling=True,  # keep the jsonl order (the official prediction files follow it)
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    root = self._jsonl_dir if self._jsonl_dir is not None else pathlib.Path(dl_manager.manual_dir)
    task = _TASK_OF_CONFIG[self.builder_config.name]
    examples = longbench.read_jsonl_dir(root, datasets=[task])[task]
    return {"test": self._generate_examples(examples)}

  def _generate_examples(self, examples: list[longbench.Example]):
    for i, ex in enumerate(examples):
      yield i, {
          "input": ex.input, "context": ex.context, "answers": list(ex.answers),
          "all_classes": list(ex.all_classes or ()), "length": ex.length, "dataset": ex.dataset,
          "language": ex.language, "_id": ex.id,
      }


def _text(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def example_from_record(record: Mapping[str, Any]) -> longbench.Example:
  """A ``longbench.Example`` from one decoded data-source record (bytes become str; empty classes -> None)."""
  classes = tuple(_text(c) for c in record["all_classes"])
  return longbench.Example(
      input=_text(record["input"]), context=_text(record["context"]),
      answers=tuple(_text(a) for a in record["answers"]), length=int(record["length"]),
      dataset=_text(record["dataset"]), language=_text(record["language"]),
      all_classes=classes or None, id=_text(record["_id"]))


def load_data_source(dataset: str, jsonl_dir: str | pathlib.Path, data_dir: str | pathlib.Path):
  """Build (once) the task's array_record files under ``data_dir`` and return its 'test' data source."""
  return tfds.data_source(f"longbench/{config_name(dataset)}", split="test", data_dir=str(data_dir),
                          builder_kwargs={"jsonl_dir": str(jsonl_dir)})
